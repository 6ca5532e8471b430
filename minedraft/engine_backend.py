"""The engine backend of a local stack (``minedraft up --engine native|vllm``), torch-free.

``native`` runs both engine services on our transformers engine in this Python. ``vllm`` runs
them on vLLM (``specdec.vllm_backend``): in the Python given by ``--engine-python``, else this
one when it has vLLM (the GPU host), else ``.venv-vllm/bin/python`` beside the repo (the CPU
build, made by ``bash bench/engines/setup_vllm.sh``). Each vLLM engine is sized here:

- on a GPU, the fraction of GPU memory it may take (``--gpu-memory-utilization``): a drafter
  sharing the verifier's GPU gets ``SHARED_GPU_UTILIZATION["drafter"]`` and the verifier the
  rest of ``SHARED_GPU_UTILIZATION``; an engine with its GPU to itself ``OWN_GPU_UTILIZATION``;
- on CPU, the KV cache (``--kv-cache-space-gib``): what 2m requests of ``max_model_len`` (+ k
  lookahead and a block of slack) need, from the model's config (``specdec.models.footprint``);
- the verifier's vLLM speculative config takes up to k draft tokens (0 in ``ar``: a plain
  decoding engine) and vLLM's own tensor parallelism (``--tensor-parallel-size``, no torchrun).
"""
from __future__ import annotations

import importlib.util
import os
import sys

from specdec.engine_api import ENGINES  # noqa: F401  (torch-free; part of this module's API)
from specdec.models.footprint import GIB, model_footprint

SHARED_GPU_UTILIZATION = {"verifier": 0.55, "drafter": 0.3}
OWN_GPU_UTILIZATION = 0.85
VLLM_VENV_PYTHON = os.path.join(".venv-vllm", "bin", "python")
VLLM_CPU_BLOCK_TOKENS = 128   # vLLM's CPU KV block: each request's tokens round up to whole blocks
MIN_KV_GIB = 0.25
# `ar` steps' tokens per request and Verify call (``--decode-steps``) when none is given. vLLM: 32,
# whose verifier admits a newcomer between two steps of a running call
# (``specdec.vllm_backend.joining``) and ends a row at its max_tokens or stop token at once
# (``specdec.vllm_backend.row_ends``), so long calls cost neither TTFT nor late finishes (H200,
# 8B shape: 0.46-0.53x of vLLM's server at 1 token per call, 0.90-0.97x at 32; BENCHMARKS.md).
# native: 1, whose verifier admits newcomers only after a call (their TTFT would grow by it).
DEFAULT_DECODE_STEPS = {"native": 1, "vllm": 32}


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_python(engine: str, explicit: str = "") -> str:
    """The Python that runs the engine services (see module docstring).

    Raises:
        ValueError: ``engine`` is vllm and no Python with vLLM is found (naming the fix).
    """
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise ValueError(f"engine_python: --engine-python {explicit!r} is not an executable file")
        return explicit
    if engine != "vllm" or importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = os.path.join(repo_root(), VLLM_VENV_PYTHON)
    if os.path.isfile(candidate):
        return candidate
    raise ValueError("engine: vllm is not installed in this Python and there is no .venv-vllm; run "
                     "`bash bench/engines/setup_vllm.sh` or pass --engine-python PATH")


def vllm_service_args(cfg, role: str, model_dir: str) -> list[str]:
    """Extra flags of the verifier (``role="verifier"``) or drafter on ``--engine vllm``."""
    args = ["--engine", "vllm"]
    if cfg.enforce_eager:
        args.append("--enforce-eager")
    if cfg.placement.is_cuda:
        args += ["--gpu-memory-utilization", f"{gpu_memory_utilization(cfg, role):g}"]
    else:
        args += ["--kv-cache-space-gib", f"{kv_cache_gib(cfg, role, model_dir):.3f}"]
    if role == "verifier":
        k = 0 if cfg.mode == "ar" else cfg.num_speculative_tokens
        args += ["--tensor-parallel-size", str(cfg.tensor_parallel_size), "--num-speculative-tokens", str(k)]
    elif cfg.draft_sessions:
        args.append("--draft-sessions")
    elif cfg.draft_proposer:   # tokens 2..k of a draft call from the proposer: one engine step per call
        args += ["--draft-proposer-tokens", str(cfg.num_speculative_tokens - 1)]
    return args


def gpu_memory_utilization(cfg, role: str) -> float:
    if cfg.gpu_memory_utilization is not None and role == "verifier":
        return cfg.gpu_memory_utilization
    if cfg.placement.is_shared_gpu and cfg.has_drafter:
        return SHARED_GPU_UTILIZATION[role]
    return OWN_GPU_UTILIZATION


def kv_cache_gib(cfg, role: str, model_dir: str) -> float:
    """GiB of CPU KV cache for 2m requests of ``max_model_len + k`` tokens, each rounded up to whole
    vLLM blocks plus one (``specdec.vllm_backend.engine.check_kv_capacity`` asks the rounded
    amount), or ``MIN_KV_GIB`` when the model's config cannot be read."""
    block = VLLM_CPU_BLOCK_TOKENS
    tokens = (-(-(cfg.max_model_len + cfg.num_speculative_tokens) // block) + 1) * block
    try:
        footprint = model_footprint(role, model_dir, cfg.dtype, cfg.num_engine_slots, tokens)
    except (OSError, KeyError, ValueError):
        return MIN_KV_GIB
    return max(MIN_KV_GIB, footprint.kv_cache_bytes / GIB)
