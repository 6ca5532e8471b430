"""The vLLM engine behind the MineDraft engine services: configuration, construction, stepping.

One ``vllm.v1.engine.llm_engine.LLMEngine`` per service process, with its engine core in the
same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the service's single engine thread
drives it step by step (``add_request``, ``step``, ``abort_request``: vLLM's public offline
API) and can name the batch of each step to ``PsdScheduler`` (``scheduler_config.
scheduler_cls``). Tensor parallelism is vLLM's own (``tensor_parallel_size``: vLLM starts its
worker processes); the paged KV cache, CUDA graphs and kernels are vLLM's.

Speculative decoding in the target engine: ``speculative_config`` method ``custom_class`` with
``ExternalDraftProposer`` (the drafts come from our drafter), vLLM's rejection sampler, or
its benchmark-only ``rejection_sample_method="synthetic"`` for ``--bench-fixed-acceptance P``
(per-position unconditional acceptance rates P, P^2, ..., P^k: the same process as
``specdec.sample.fixed_acceptance``, each draft token accepted with probability P given its
predecessors were).

Capacity: the KV cache must hold ``max_num_seqs x max_model_len`` tokens (``check_kv_capacity``
at start-up, ``CapacityError`` otherwise), so that PSD's paused batch never loses its KV.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from specdec.errors import CapacityError
from specdec.sample.sampling import NO_LOGPROBS, TOP_K_OFF, SamplingParams

logger = logging.getLogger(__name__)

SCHEDULER_CLS = "specdec.vllm_backend.scheduler.PsdScheduler"
ASYNC_SCHEDULER_CLS = "specdec.vllm_backend.scheduler.PsdAsyncScheduler"
PROPOSER_CLS = "specdec.vllm_backend.proposer.ExternalDraftProposer"
DEVICES = ("cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy", "safetensors")
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine core in this process: we step it ourselves
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",      # flashinfer is not installed on the GPU host
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
}
CUDA_ENV_DEFAULTS = {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"}   # vLLM's bundled flash-attention (GPU host)
VLLM_BLOCK_SIZE = {"cpu": 128, "cuda": 16}   # vLLM's KV block tokens where block_size is left open
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")   # vLLM's CUDAGraphMode
VLLM_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"   # vLLM's default where cudagraph_mode is left open


@dataclass(frozen=True)
class VllmEngineConfig:
    """Settings of one vLLM engine (target or draft).

    Attributes:
        model: local Hugging Face model dir (config.json; weights unless ``load_format`` is dummy).
        device: ``cpu`` (vLLM's CPU build) or ``cuda`` (the GPUs in ``CUDA_VISIBLE_DEVICES``).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        max_num_seqs: requests resident at once (KV slots).
        max_model_len: tokens (prompt + output) per request.
        tensor_parallel_size: vLLM's TP degree (target only).
        num_speculative_tokens: k of the target's speculative config (0: no speculation; the
            engine then only decodes, as ``ar`` needs).
        fixed_acceptance: BENCHMARK-ONLY: accept each draft token with this probability (vLLM's
            synthetic rejection sampler); None: vLLM's lossless rejection sampler.
        load_format: ``auto`` (weights from ``model``) or ``dummy`` (random weights of its shape).
        gpu_memory_utilization: fraction of the GPU this engine may take (weights + KV + graphs).
        kv_cache_space_gib: CPU only: KV cache size (vLLM's ``kv_cache_memory_bytes``).
        enforce_eager: no CUDA graphs / torch.compile (faster start, slower steps).
        enable_prefix_caching: vLLM's automatic prefix caching (the drafter relies on it).
        max_num_batched_tokens: tokens per engine step (None: ``max(max_model_len,
            max_num_seqs * (k + 1))``, so one step holds a whole verify batch or a whole prompt).
        block_size: tokens per paged KV-cache block (None: vLLM's platform default,
            ``VLLM_BLOCK_SIZE``; vLLM's CPU attention needs a multiple of 32).
        max_cudagraph_capture_size: CUDA: the largest step (tokens) vLLM captures CUDA graphs for;
            a larger step runs without graphs (None: vLLM's default,
            ``vllm_default_cudagraph_capture_size``).
        cudagraph_mode: CUDA: vLLM's ``compilation_config.cudagraph_mode`` (e.g. ``FULL``: whole
            graphs for mixed prefill + decode steps too, where the attention backend allows;
            None: vLLM's default, ``VLLM_CUDAGRAPH_MODE``).
        seed: vLLM's global seed (requests carry their own seeds).
        async_scheduling: vLLM's async scheduling (step i + 1 scheduled while step i runs), for
            an engine without speculation (the drafter, and the verifier of ``ar``); vLLM's CPU
            platform turns it off. The scheduler is ``PsdAsyncScheduler`` then.
        proposer_tokens: draft engine only: n > 0 gives the engine a proposer of its own, vLLM's
            ``draft_model`` speculative method with this same model, which after each step's
            sampled token proposes the next n greedy tokens inside the step (n more forward
            passes, no more engine steps); ``VllmDraftWorker`` takes them as the draft's tokens
            2..n+1, so a draft call of k <= n + 1 takes one engine step instead of k (0: off).
    """

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 16
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    num_speculative_tokens: int = 0
    fixed_acceptance: float | None = None
    load_format: str = "auto"
    gpu_memory_utilization: float = 0.85
    kv_cache_space_gib: float = 1.0
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    max_cudagraph_capture_size: int | None = None
    cudagraph_mode: str | None = None
    seed: int = 0
    async_scheduling: bool = False
    proposer_tokens: int = 0

    def __post_init__(self) -> None:
        checks = {
            "device": (self.device in DEVICES, f"must be one of {DEVICES}"),
            "dtype": (self.dtype in ("float32", "bfloat16", "float16"), "must be float32, bfloat16 or float16"),
            "max_num_seqs": (self.max_num_seqs >= 1, "must be >= 1"),
            "max_model_len": (self.max_model_len >= 2, "must be >= 2"),
            "tensor_parallel_size": (self.tensor_parallel_size >= 1, "must be >= 1"),
            "num_speculative_tokens": (self.num_speculative_tokens >= 0, "must be >= 0"),
            "fixed_acceptance": (self.fixed_acceptance is None
                                 or (0.0 <= self.fixed_acceptance <= 1.0 and self.num_speculative_tokens > 0
                                     and self.device == "cuda"),
                                 "must be in [0, 1] and needs num_speculative_tokens > 0 and device cuda "
                                 "(vLLM's synthetic rejection sampler has no CPU version)"),
            "load_format": (self.load_format in LOAD_FORMATS, f"must be one of {LOAD_FORMATS}"),
            "gpu_memory_utilization": (0.0 < self.gpu_memory_utilization <= 1.0, "must be in (0, 1]"),
            "kv_cache_space_gib": (self.kv_cache_space_gib > 0, "must be > 0"),
            "max_num_batched_tokens": (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                                       "must be >= 1"),
            "block_size": (self.block_size is None or self.block_size >= 1, "must be >= 1"),
            "max_cudagraph_capture_size": (self.max_cudagraph_capture_size is None
                                           or self.max_cudagraph_capture_size >= 1, "must be >= 1"),
            "cudagraph_mode": (self.cudagraph_mode in (None,) + CUDAGRAPH_MODES,
                               f"must be one of {CUDAGRAPH_MODES}"),
            "async_scheduling": (not self.async_scheduling or self.num_speculative_tokens == self.proposer_tokens == 0,
                                 "needs num_speculative_tokens and proposer_tokens 0 (verify steps are one per call)"),
            "proposer_tokens": (self.proposer_tokens >= 0 and not (self.proposer_tokens and self.num_speculative_tokens),
                                "must be >= 0, and 0 where num_speculative_tokens is set (a target engine)"),
        }
        for name, (is_ok, reason) in checks.items():
            if not is_ok:
                raise ValueError(f"{name}: {reason}, got {getattr(self, name)!r}")

    @property
    def batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(self.max_model_len, self.max_num_seqs * (max(self.num_speculative_tokens, self.proposer_tokens) + 1))

    @property
    def chunked_prefill(self) -> bool:
        """vLLM's chunked prefill, off on CPU where one step holds a whole prompt (a step budget
        of at least ``max_model_len``): vLLM 0.32's CPU build crashes when a seeded, sampled
        request's prompt is split over steps (it discards the partial step's sample by rewinding
        the request's generator with ``set_offset``, which CPU generators lack: "CPU Generator
        does not use offset"), and the verifier seeds every request. A prompt that does not fit
        beside the step's other tokens then waits for a later step, whole."""
        return self.device != "cpu" or self.batched_tokens < self.max_model_len

    def vllm_default_cudagraph_capture_size(self) -> int:
        """What vLLM 0.24 takes for ``max_cudagraph_capture_size`` when it is left open:
        ``min(max_num_seqs x (k + 1) x 2, 512)``, at most the step budget."""
        return min(self.max_num_seqs * (self.num_speculative_tokens + 1) * 2, 512, self.batched_tokens)

    def compilation_config(self) -> dict:
        """The ``compilation_config`` entries set here (empty: vLLM's defaults)."""
        config = {"max_cudagraph_capture_size": self.max_cudagraph_capture_size, "cudagraph_mode": self.cudagraph_mode}
        return {name: value for name, value in config.items() if value is not None}

    def speculative_config(self) -> dict | None:
        """vLLM's ``speculative_config`` (None without speculation)."""
        if self.proposer_tokens:
            return {"method": "draft_model", "model": self.model, "num_speculative_tokens": self.proposer_tokens}
        if self.num_speculative_tokens == 0:
            return None
        config = {"method": "custom_class", "model": PROPOSER_CLS,
                  "num_speculative_tokens": self.num_speculative_tokens}
        if self.fixed_acceptance is not None:
            p = self.fixed_acceptance
            config.update(rejection_sample_method="synthetic",
                          synthetic_acceptance_rates=[p ** i for i in range(1, self.num_speculative_tokens + 1)])
        return config


def build_engine(cfg: VllmEngineConfig):
    """An in-process ``LLMEngine`` for ``cfg`` with ``PsdScheduler`` (blocking: loads the model,
    profiles memory, captures CUDA graphs).

    Raises:
        CapacityError: the KV cache vLLM could allocate holds fewer than ``max_num_seqs x
            max_model_len`` tokens (``check_kv_capacity``).
        ImportError: vLLM is not installed in this Python.
    """
    for name, value in {**ENV_DEFAULTS, **(CUDA_ENV_DEFAULTS if cfg.device == "cuda" else {})}.items():
        os.environ.setdefault(name, value)
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=cfg.model, skip_tokenizer_init=True, dtype=cfg.dtype, seed=cfg.seed,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.batched_tokens, enable_chunked_prefill=cfg.chunked_prefill,
        tensor_parallel_size=cfg.tensor_parallel_size,
        load_format=cfg.load_format, enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching,
        scheduler_cls=ASYNC_SCHEDULER_CLS if cfg.async_scheduling else SCHEDULER_CLS,
        speculative_config=cfg.speculative_config(), async_scheduling=cfg.async_scheduling, disable_log_stats=True,
        **({"block_size": cfg.block_size} if cfg.block_size is not None else {}),
        **({"compilation_config": compilation} if (compilation := cfg.compilation_config()) else {}),
        **({"gpu_memory_utilization": cfg.gpu_memory_utilization} if cfg.device == "cuda"
           else {"kv_cache_memory_bytes": int(cfg.kv_cache_space_gib * 2**30)}))
    engine = LLMEngine.from_engine_args(args)
    if cfg.device == "cpu":
        from specdec.vllm_backend.cpu_fixes import fix_cpu_rejection_sampler

        fix_cpu_rejection_sampler()
    try:
        check_kv_capacity(engine, cfg)
    except CapacityError:
        # shut down now: left to the garbage collector, its teardown (vLLM's
        # cleanup_dist_env_and_memory) would destroy the distributed state of whatever engine
        # this process builds next
        engine.engine_core.shutdown()
        raise
    return engine


def scheduler_of(engine):
    """The engine core's ``PsdScheduler`` / ``PsdAsyncScheduler`` (the engine core runs in this process)."""
    from specdec.vllm_backend.scheduler import PsdSchedulerMixin

    scheduler = engine.engine_core.engine_core.scheduler
    if not isinstance(scheduler, PsdSchedulerMixin):
        raise RuntimeError(f"expected PsdScheduler in the engine core, got {type(scheduler).__name__}")
    return scheduler


def drain(engine, max_steps: int = 64) -> None:
    """Step an engine whose requests have all finished until async scheduling's batch queue is
    empty (a step scheduled past the end; a synchronous engine has no queue). Raises
    RuntimeError if it does not drain in ``max_steps``."""
    core = engine.engine_core.engine_core
    for _ in range(max_steps):
        if not getattr(core, "batch_queue", None):
            return
        engine.step()
    raise RuntimeError("vLLM's batch queue did not drain")


def kv_cache_tokens(engine) -> int:
    """Tokens the engine's paged KV cache holds (blocks x block size)."""
    cache = engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def check_kv_capacity(engine, cfg: VllmEngineConfig) -> None:
    """Raise ``CapacityError`` (at start-up, never mid-traffic) unless the KV cache holds every
    resident request at full length: ``max_num_seqs x max_model_len`` tokens, plus one block per
    request for vLLM's lookahead slots of the draft tokens."""
    block = int(engine.vllm_config.cache_config.block_size)
    blocks_per_seq = -(-(cfg.max_model_len + cfg.num_speculative_tokens) // block)
    needed = cfg.max_num_seqs * blocks_per_seq * block
    have = kv_cache_tokens(engine)
    if have < needed:
        raise CapacityError(f"vLLM KV cache holds {have} tokens, max_num_seqs={cfg.max_num_seqs} x max_model_len="
                            f"{cfg.max_model_len} needs {needed}: lower --max-num-seqs / --max-model-len or give "
                            "it more memory (--gpu-memory-utilization; on CPU the engine service's "
                            "--kv-cache-space-gib, which minedraft up sizes from the model)")


@contextlib.contextmanager
def refusals_as_value_errors():
    """vLLM's refusal of a request (``vllm.exceptions.VLLMValidationError`` / ``VLLMClientError``,
    e.g. temperature > 2, or min_p with speculative decoding) as ``ValueError`` with vLLM's
    message naming the parameter, so the services answer INVALID_ARGUMENT for that request only.
    (In vLLM 0.24 the class is a ValueError already; in 0.32 it is not.)"""
    from vllm import exceptions

    refusals = tuple(getattr(exceptions, name) for name in ("VLLMClientError", "VLLMValidationError")
                     if hasattr(exceptions, name))
    try:
        yield
    except refusals as exc:
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"refused by vLLM: {exc}") from exc


def to_vllm_sampling(params: SamplingParams, max_tokens: int, seed: int | None = None, with_logprobs: bool = True):
    """vLLM ``SamplingParams`` of an engine request: the same temperature / top-k / top-p / min-p,
    presence / frequency / repetition penalties (vLLM's rejection sampler counts the draft tokens
    before each position as output, as ``specdec.sample.penalties`` does) and seed, EOS and stop
    handling off (the coordinator finishes requests), ``max_tokens`` output tokens, token ids only (no detokenizer), deltas per step, and the sampled token's
    raw logprob plus ``params.logprobs`` top logprobs (vLLM's ``raw_logprobs``: log-softmax of
    the unprocessed logits, as ``specdec.engine.worker_base.StepOutput`` defines them); none at all
    without ``with_logprobs`` (draft tokens: nobody reads their logprobs) or when ``params.logprobs``
    is ``NO_LOGPROBS`` (the client asked none: vLLM then skips the log-softmax and its output).
    Each call returns a new object dedicated to one request, so it is marked ``skip_clone``: vLLM's
    input processing then copies it shallowly instead of deep-copying it (a third of
    ``LLMEngine.add_request``'s time, which the drafter pays for every row of every draft call)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=1, temperature=params.temperature, top_k=0 if params.top_k == TOP_K_OFF else params.top_k,
        top_p=params.top_p, min_p=params.min_p, seed=params.seed if seed is None else seed,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        max_tokens=max_tokens, ignore_eos=True,
        logprobs=params.logprobs if with_logprobs and params.logprobs != NO_LOGPROBS else None,
        detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA, skip_clone=True)
