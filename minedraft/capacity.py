"""Start-up memory check of a whole stack: ``check_memory`` before any engine starts.

The sizes come from ``specdec.models.footprint`` (torch-free: safetensors headers and
``config.json``), which drafter_svc also uses before it loads its model. A configuration that
cannot fit fails at start with ``InsufficientMemoryError``, never mid-traffic.
"""
from __future__ import annotations

from minedraft.stack import StackConfig, resolve_draft_dir
from specdec.models.footprint import GIB, check_fits, model_footprint


def check_memory(cfg: StackConfig, model_dir: str, log=print) -> None:
    """Count target and draft weights plus both engines' KV caches (2m slots of ``max_model_len``)
    against available memory before anything starts (``specdec.models.footprint``). Models whose files
    cannot be read are left to their service to report.

    Raises:
        InsufficientMemoryError: the configuration cannot fit.
    """
    if cfg.placement.is_cuda:  # weights and KV caches live on the GPUs, not in this host's memory
        log("memory check skipped: engines on cuda")
        return
    dirs = [("target", model_dir)] + ([("draft", resolve_draft_dir(cfg, model_dir))] if cfg.has_drafter else [])
    try:
        footprints = [model_footprint(name, path, cfg.dtype, cfg.num_engine_slots, cfg.max_model_len)
                      for name, path in dirs]
    except (OSError, KeyError, ValueError) as exc:
        log(f"memory check skipped: {exc}")
        return
    total = check_fits(footprints)
    log(f"memory: {total / GIB:.2f} GiB for weights and KV caches ({', '.join(name for name, _ in dirs)})")
