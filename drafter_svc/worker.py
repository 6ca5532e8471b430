"""How the drafter builds its draft engine: the native ``DraftWorker``, vLLM's drafters, or P of
either in processes of their own (``--draft-processes``; ``drafter_svc.processes``)."""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import os

from specdec.models.footprint import GIB, check_fits, model_footprint

logger = logging.getLogger("drafter_svc")


def build_draft_engine(args: argparse.Namespace, on_lost=None):
    """The drafter's engine (blocking: loads the model): ``load_worker(args)`` in this process,
    or with ``--draft-processes P`` > 1 a ``DraftProcesses`` over P of them (``on_lost``: called
    when one of them dies)."""
    if args.draft_processes == 1:
        return load_worker(args)
    from drafter_svc.processes import DraftProcesses

    return DraftProcesses(process_builds(args), log_level=args.log_level.upper(), on_lost=on_lost)


def process_builds(args: argparse.Namespace) -> list:
    """One ``load_worker`` call per draft process, each with ``M // P`` of the ``M`` slots
    (``--max-num-seqs``; the first ``M % P`` one more), 1/P of ``--gpu-memory-utilization``, ``--kv-cache-space-gib`` and
    ``--num-threads``, and its own ``--seed`` (seed + i), so unseeded requests in different
    processes do not share per-request seeds."""
    num = args.draft_processes
    builds = []
    for i in range(num):
        child = copy.copy(args)
        child.draft_processes = 1
        child.max_num_seqs = args.max_num_seqs // num + (i < args.max_num_seqs % num)
        child.gpu_memory_utilization = args.gpu_memory_utilization / num
        child.kv_cache_space_gib = args.kv_cache_space_gib / num
        child.num_threads = None if args.num_threads is None else max(1, args.num_threads // num)
        child.seed = None if args.seed is None else args.seed + i
        builds.append(functools.partial(load_worker, child))
    return builds


def _target_vocab_size(args: argparse.Namespace, draft_dir: str) -> int | None:
    """Vocab size of ``--model`` (None without it); checks tokenizer compatibility when both
    dirs ship a tokenizer (raises ``IncompatibleDraftError``)."""
    if args.model is None:
        return None
    from transformers import AutoConfig

    from specdec.config import ModelConfig
    from specdec.models.loader import check_vocab_compat
    from specdec.models.resolve import resolve_model_dir

    target_dir = resolve_model_dir(ModelConfig(model=args.model))
    if all(os.path.isfile(os.path.join(d, "tokenizer_config.json")) for d in (target_dir, draft_dir)):
        check_vocab_compat(target_dir, draft_dir)
    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return int(config.get_text_config().vocab_size)


def check_draft_memory(draft_dir: str, args: argparse.Namespace) -> None:
    """Draft weights + draft KV (``--max-num-seqs`` x ``--max-model-len``) against available memory,
    before anything is allocated. Raises ``specdec.models.footprint.InsufficientMemoryError``."""
    try:
        footprint = model_footprint("draft", draft_dir, args.dtype, args.max_num_seqs, args.max_model_len)
    except (OSError, KeyError) as exc:  # e.g. a GGUF draft: no safetensors header to read
        logger.warning("draft memory check skipped: %s", exc)
        return
    total = check_fits([footprint])
    logger.info("draft memory: %.3f GiB (weights %.3f, KV cache %.3f)", total / GIB,
                footprint.weight_bytes / GIB, footprint.kv_cache_bytes / GIB)


def load_worker(args: argparse.Namespace):
    """Build the ``DraftWorker`` (blocking: loads the model)."""
    if args.engine == "vllm":
        return _load_vllm_worker(args)
    from specdec.config import CacheConfig, ModelConfig
    from specdec.models.resolve import resolve_model_dir
    from specdec.engine.runner import ModelRunner
    from specdec.engine.worker import DraftWorker

    model_cfg = ModelConfig(model=args.draft, gguf_file=args.draft_gguf_file, dtype=args.dtype,
                            device=args.device, num_threads=args.num_threads,
                            max_prefill_tokens=args.max_prefill_tokens,
                            max_graph_prefill_tokens=args.max_graph_prefill_tokens)
    cache_cfg = CacheConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    draft_dir = resolve_model_dir(model_cfg)
    check_draft_memory(draft_dir, args)
    target_vocab_size = _target_vocab_size(args, draft_dir)
    runner = ModelRunner(model_cfg, cache_cfg)
    return DraftWorker(runner, target_vocab_size=target_vocab_size, seed=args.seed)


def _load_vllm_worker(args: argparse.Namespace):
    """``VllmDraftWorker`` (with ``--draft-proposer-tokens``: drafting with vLLM's draft-model
    proposer), or ``VllmSessionDraftWorker`` with ``--draft-sessions`` (a MineDraft draft dir is
    exported to a standalone HF dir first)."""
    from engine_svc.service import vllm_engine_config
    from specdec.config import ModelConfig
    from specdec.models.resolve import resolve_model_dir
    from specdec.vllm_backend.draft import VllmDraftWorker
    from specdec.vllm_backend.draft_sessions import VllmSessionDraftWorker
    from specdec.vllm_backend.models import resolve_vllm_model

    target_dir = None if args.model is None else resolve_model_dir(ModelConfig(model=args.model))
    draft_dir, load_format = resolve_vllm_model(args.draft, target_dir)
    target_vocab_size = _target_vocab_size(args, draft_dir)
    if args.draft_sessions:
        cfg = vllm_engine_config(args, draft_dir, load_format, enable_prefix_caching=False)
        return VllmSessionDraftWorker(cfg, target_vocab_size, seed=args.seed)
    cfg = vllm_engine_config(args, draft_dir, load_format, proposer_tokens=args.draft_proposer_tokens)
    if cfg.proposer_tokens and cfg.device == "cuda":
        logger.warning("--draft-proposer-tokens: vLLM 0.24 runs the draft_model proposer on its V1 model runner; "
                       "a draft call measured 3.7-4.2x slower than k-step drafting on an H100 (BENCHMARKS.md)")
    return VllmDraftWorker(cfg, target_vocab_size, seed=args.seed)
