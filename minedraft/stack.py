"""Configuration of a local MineDraft stack and the command line of each service (torch-free).

Used by ``minedraft up`` (``minedraft.launcher``) and the demo. Ports follow
docs/ARCHITECTURE.md: gateway 50051, coordinator 50052, drafter 50053, verifier 50054,
torch.distributed data plane 29600.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from coordinator.config import DEFAULT_STREAM_INTERVAL, DEFAULT_STREAM_INTERVAL_MS, MAX_DECODE_STEPS, MAX_STREAM_INTERVAL_MS
from gateway.config import DEFAULT_MAX_N
from specdec.sample.bench_only import check_acceptance_prob, fixed_acceptance_label
from minedraft.draft_choice import (DEFAULT_DRAFT_DIR, DEFAULT_TRUNCATED_LAYERS, draft_fits_target,  # noqa: F401
                                     resolve_draft_dir)  # (part of the stack API)
from minedraft.engine_backend import DEFAULT_DECODE_STEPS, ENGINES, engine_python, vllm_service_args
from minedraft.placement import ALL_SMS, NO_GPU, NO_GPUS, Placement
from minedraft.probes import free_loopback_ports  # noqa: F401  (part of the stack API)

MODES = ("ar", "sd", "psd", "auto")  # auto: the coordinator picks ar / sd / psd per step (coordinator.auto_mode)
K_POLICIES = ("fixed", "adaptive")  # coordinator.adaptive
BALANCERS = ("paper", "feedback")  # coordinator.balancer
DATA_PLANES = ("inline", "dist", "ipc")
# ipc and dist are both out of band for the coordinator (it passes step ids; the engines pick the transport)
_COORDINATOR_PLANE = {"inline": "inline", "dist": "dist", "ipc": "dist"}


def default_data_plane(device: str, engine: str = "native") -> str:
    """``ipc`` for native GPU engines (one host: CUDA IPC beat NCCL in every measured shape,
    ~0.1-0.3 ms vs ~0.3-0.9 ms a step on two H200; BENCHMARKS.md), ``inline`` on CPU (the demo
    default) and on the vLLM engine (only draft token ids travel: vLLM verifies without q)."""
    return "ipc" if device.startswith("cuda") and engine == "native" else "inline"
DEFAULT_TARGET = "smollm2-135m-instruct"
VERIFIER_CPU, DRAFTER_CPU = 0, 1  # indexes into the CPUs this process may use
NO_PINNING: tuple[int, ...] = ()

DEFAULT_BATCHED_TOKENS = {"cpu": 4096, "cuda": 8192}  # vLLM's max_num_batched_tokens defaults


@dataclass(frozen=True)
class StackConfig:
    """Settings of ``minedraft up``.

    Attributes:
        mode: ``ar`` (target alone), ``sd`` (standard speculative decoding), ``psd`` (MineDraft) or
            ``auto`` (the coordinator picks one of them per step).
        num_speculative_tokens: k, draft tokens per request and step.
        max_num_seqs: m, requests per batch; the engines get ``2m`` KV slots (PSD keeps 2 batches).
        tensor_parallel_size: verifier ranks (torchrun when > 1).
        data_plane: ``inline`` (draft probs in gRPC), ``dist`` (torch.distributed: NCCL between
            GPUs, else gloo) or ``ipc`` (same host: CUDA IPC / shared memory; specdec.dataplane.ipc).
        target: target model alias or dir; draft: draft dir ("" = default, see ``resolve_draft_dir``).
        max_model_len: tokens (prompt + output) per request, same in every service.
        dtype: engine parameter / KV dtype.
        is_pinned: pin verifier to core 0 and drafter to core 1 (one torch thread each, always).
        num_engine_threads: torch threads per engine process (1 by default; the benchmark's
            ``sd-2core`` runs unpinned engines with 2 threads each).
        host, *_port: loopback addresses of the services.
        http_port: the gateway's OpenAI-compatible HTTP port (0 = no HTTP API).
        runs_dir: logs go to ``<runs_dir>/<timestamp>/<service>.log``.
        metrics_port: the coordinator's Prometheus ``/metrics`` port (0 = off).
        step_log: JSONL file the coordinator appends one record per step to ("" = off;
            ``minedraft timeline`` draws it).
        startup_timeout_s, stop_timeout_s: seconds to reach SERVING / to exit after SIGTERM.
        device, verifier_gpus, drafter_gpu, cuda_mps, verifier_sm_percent: engine placement (``minedraft.placement.Placement``;
            on cuda no core pinning, each engine sees only its GPUs).
        bench_fixed_acceptance: BENCHMARK-ONLY: the verifier accepts each draft token with this
            probability instead of rejection sampling (``specdec.sample.fixed_acceptance``); changes the
            output distribution. None (default) = off.
        k_policy: the coordinator's ``--k-policy`` (``fixed`` or ``adaptive``).
        balancer: the coordinator's ``--balancer`` (``paper`` or ``feedback``).
        max_prefill_tokens: the engines' ``--max-prefill-tokens`` (prompts admitted together are
            prefilled in one forward up to this many padded tokens; 0 = one per forward). None:
            the engines' default (8192 on CUDA, 0 on CPU; ``specdec.config.ModelConfig``).
        max_graph_prefill_tokens: the engines' ``--max-graph-prefill-tokens`` (one-prompt
            prefills up to this length replay a CUDA graph per length bucket; 0 = off). None: the
            engines' default (1024 while CUDA graphs are on, else 0).
        max_num_batched_tokens: the coordinator's ``--max-num-batched-tokens`` (prompt tokens
            admitted between two steps; 0 = no limit). None: vLLM's defaults, 4096 on CPU and
            8192 on CUDA (``DEFAULT_BATCHED_TOKENS``).
        engine: what runs the models in both engine services: ``native`` or ``vllm``
            (``minedraft.engine_backend``); engine_python: the Python of vLLM engines ("" = found).
        gpu_memory_utilization: vLLM verifier's share of its GPU (None: ``engine_backend``'s default).
        enforce_eager: vLLM engines without torch.compile / CUDA graphs.
        draft_sessions: the vLLM drafter keeps each request's draft request resident
            (``--draft-sessions``; ``specdec.vllm_backend.draft_sessions``).
        draft_proposer: the vLLM drafter drafts with vLLM's own draft-model proposer, k - 1
            tokens inside the step after each sampled one (``--draft-proposer``; the drafter's
            ``--draft-proposer-tokens``): one engine step per draft call instead of k.
        draft_processes: the drafter's engine as that many processes, each request homed on one
            (``--draft-processes``; ``drafter_svc.processes``); 1: one engine in the drafter.
        api_key: the gateway's API key ("" = the gateway's default, ``$MINEDRAFT_API_KEY`` if set);
            passed in the gateway's environment, not on its command line.
        max_queue_len: the coordinator's waiting-request limit; grace_s: drain seconds on SIGTERM
            of the coordinator and the gateway.
        num_decode_steps: the coordinator's ``--decode-steps`` (tokens per request and Verify
            call in ``ar`` steps: multi-step decoding; 1 = one; None: the engine's default,
            ``engine_backend.DEFAULT_DECODE_STEPS``: 32 on vllm, 1 on native); stream_decode_steps: its
            ``--[no-]stream-decode-steps`` (tokens reach the streams as each step decodes them);
            stream_interval: its ``--stream-interval`` (decode steps per streamed partial message).
            stream_interval_ms: its ``--stream-interval-ms`` (... or a partial once this many ms passed).
    """

    mode: str = "psd"
    num_speculative_tokens: int = 4
    max_num_seqs: int = 4
    tensor_parallel_size: int = 1
    data_plane: str = "inline"
    target: str = DEFAULT_TARGET
    draft: str = ""
    max_model_len: int = 2048
    dtype: str = "float32"
    is_pinned: bool = True
    num_engine_threads: int = 1
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    http_port: int = 0
    coordinator_port: int = 50052
    drafter_port: int = 50053
    verifier_port: int = 50054
    dist_port: int = 29600
    runs_dir: str = "runs"
    metrics_port: int = 0
    step_log: str = ""
    startup_timeout_s: float = 900.0
    stop_timeout_s: float = 20.0
    device: str = "cpu"
    verifier_gpus: tuple[int, ...] = NO_GPUS
    drafter_gpu: int = NO_GPU
    cuda_mps: bool = False
    verifier_sm_percent: int = ALL_SMS
    bench_fixed_acceptance: float | None = None
    k_policy: str = "fixed"
    balancer: str = "paper"
    max_prefill_tokens: int | None = None
    max_graph_prefill_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    engine: str = "native"
    engine_python: str = ""
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    draft_sessions: bool = False
    draft_proposer: bool = False
    draft_processes: int = 1
    api_key: str = ""
    max_queue_len: int = 1024
    grace_s: float = 5.0
    num_decode_steps: int | None = None
    stream_decode_steps: bool = True
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    stream_interval_ms: int = DEFAULT_STREAM_INTERVAL_MS

    def __post_init__(self) -> None:
        checks = {
            "mode": (self.mode in MODES, f"must be one of {MODES}"),
            "num_speculative_tokens": (self.num_speculative_tokens >= 1, "must be >= 1"),
            "max_num_seqs": (self.max_num_seqs >= 1, "must be >= 1"),
            "tensor_parallel_size": (self.tensor_parallel_size >= 1, "must be >= 1"),
            "data_plane": (self.data_plane in DATA_PLANES, f"must be one of {DATA_PLANES}"),
            "k_policy": (self.k_policy in K_POLICIES, f"must be one of {K_POLICIES}"),
            "balancer": (self.balancer in BALANCERS, f"must be one of {BALANCERS}"),
            "max_model_len": (self.max_model_len >= 2, "must be >= 2"),
            "num_engine_threads": (self.num_engine_threads >= 1, "must be >= 1"),
            "startup_timeout_s": (self.startup_timeout_s > 0, "must be > 0"),
            "stop_timeout_s": (self.stop_timeout_s > 0, "must be > 0"),
            "metrics_port": (0 <= self.metrics_port <= 65535, "must be in [0, 65535] (0 = off)"),
            "http_port": (0 <= self.http_port <= 65535, "must be in [0, 65535] (0 = off)"),
            "max_prefill_tokens": (_is_count_or_none(self.max_prefill_tokens),
                                   "must be an int >= 0 (0 = one prompt per forward)"),
            "max_graph_prefill_tokens": (_is_count_or_none(self.max_graph_prefill_tokens)
                                         and not (self.max_graph_prefill_tokens
                                                  and (self.max_prefill_tokens or self.device == "cpu")),
                                         "must be an int >= 0 (0 = off); > 0 needs device cuda and "
                                         "max_prefill_tokens 0 or unset"),
            "max_num_batched_tokens": (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 0,
                                       "must be >= 0 (0 = no limit)"),
            "engine": (self.engine in ENGINES, f"must be one of {ENGINES}"),
            "max_queue_len": (self.max_queue_len >= 1, "must be >= 1"),
            "num_decode_steps": (self.num_decode_steps is None or 1 <= self.num_decode_steps <= MAX_DECODE_STEPS,
                                 f"must be in [1, {MAX_DECODE_STEPS}] (None: the engine's default)"),
            "stream_interval": (1 <= self.stream_interval <= MAX_DECODE_STEPS, f"must be in [1, {MAX_DECODE_STEPS}]"),
            "stream_interval_ms": (0 <= self.stream_interval_ms <= MAX_STREAM_INTERVAL_MS,
                                   f"must be in [0, {MAX_STREAM_INTERVAL_MS}]"),
            "grace_s": (0 <= self.grace_s < self.stop_timeout_s, "must be >= 0 and below stop_timeout_s"),
            "gpu_memory_utilization": (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                                       "must be in (0, 1]"),
            "draft_processes": (1 <= self.draft_processes <= self.num_engine_slots,
                                f"must be in [1, {self.num_engine_slots}] (the drafter's slots)"),
        }
        checks["draft_sessions"] = (not self.draft_sessions or self.engine == "vllm", "needs --engine vllm")
        checks["draft_proposer"] = (not self.draft_proposer or (self.engine == "vllm" and not self.draft_sessions
                                                                and self.num_speculative_tokens >= 2),
                                    "needs --engine vllm, k >= 2 and no --draft-sessions")
        if self.engine == "vllm":
            checks["data_plane"] = (self.data_plane == "inline", "must be inline with --engine vllm (only "
                                    "draft token ids travel: vLLM's rejection sampler needs no draft probs)")
            checks["max_prefill_tokens"] = (self.max_prefill_tokens is None and self.max_graph_prefill_tokens is None,
                                            "the prefill flags are the native engine's (vLLM batches prefills itself)")
            checks["bench_fixed_acceptance"] = (self.bench_fixed_acceptance is None or self.placement.is_cuda,
                                                "needs --device cuda with --engine vllm (vLLM's synthetic rejection "
                                                "sampler has no CPU version)")
        for name in ("gateway_port", "coordinator_port", "drafter_port", "verifier_port", "dist_port"):
            checks[name] = (0 < getattr(self, name) <= 65535, "must be in [1, 65535]")
        for name, (is_ok, reason) in checks.items():
            if not is_ok:
                raise ValueError(f"{name}: {reason}, got {getattr(self, name)!r}")
        self.placement  # validates the device flags (ValueError naming the flag)
        if self.bench_fixed_acceptance is not None:
            check_acceptance_prob(self.bench_fixed_acceptance)  # ValueError naming the flag

    @property
    def placement(self) -> Placement:
        """Where the engines run (raises ValueError naming a bad device flag)."""
        return Placement(self.device, tuple(self.verifier_gpus), self.drafter_gpu, self.tensor_parallel_size,
                         self.cuda_mps, self.verifier_sm_percent)

    @property
    def decode_steps(self) -> int:
        """The coordinator's ``--decode-steps``: ``num_decode_steps``, else the engine's default."""
        return self.num_decode_steps or DEFAULT_DECODE_STEPS[self.engine]

    @property
    def has_drafter(self) -> bool:
        """``ar`` runs the target alone: no drafter process."""
        return self.mode != "ar"

    @property
    def uses_cuda_mps(self) -> bool:
        """``--cuda-mps`` and something to share the GPU with: ``ar`` has no drafter, so its
        verifier runs as a plain CUDA process (an MPS client would only add the daemon's hop)."""
        return self.cuda_mps and self.has_drafter

    @property
    def num_engine_slots(self) -> int:
        """KV slots per engine: 2m (PSD's two batches; the same budget for every mode)."""
        return 2 * self.max_num_seqs


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the stack: its command line, health address, CPU cores, environment, and
    whether it joins the stack's private CUDA MPS daemon (``--cuda-mps``; the engines only)."""

    name: str
    argv: list[str]
    address: str
    cpus: tuple[int, ...] = NO_PINNING
    env: dict[str, str] = field(default_factory=dict)
    is_cuda_mps: bool = False


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity mask; containers may hide some)."""
    return sorted(os.sched_getaffinity(0))


def _pinned(cfg: StackConfig, index: int) -> tuple[int, ...]:
    """The ``index``-th usable CPU when pinning is on and there are at least two, else no pinning."""
    cpus = usable_cpus()
    is_pinnable = cfg.is_pinned and not cfg.placement.is_cuda  # GPU hosts: no core pinning
    return (cpus[index],) if is_pinnable and len(cpus) > DRAFTER_CPU else NO_PINNING


def _engine_args(cfg: StackConfig, port: int, num_threads: int) -> list[str]:
    return ["--dtype", cfg.dtype, "--max-num-seqs", str(cfg.num_engine_slots),
            "--max-model-len", str(cfg.max_model_len), "--num-threads", str(num_threads),
            "--host", cfg.host, "--port", str(port), "--data-plane", cfg.data_plane,
            "--dist-port", str(cfg.dist_port), "--ipc-name", f"stack-{cfg.dist_port}",
            *(["--max-prefill-tokens", str(cfg.max_prefill_tokens)] if cfg.max_prefill_tokens is not None else []),
            *(["--max-graph-prefill-tokens", str(cfg.max_graph_prefill_tokens)]
              if cfg.max_graph_prefill_tokens is not None else [])]


def _is_count_or_none(value) -> bool:
    """None, or an int >= 0 (not a bool)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def verifier_spec(cfg: StackConfig, model_dir: str) -> ServiceSpec:
    """Verifier: one torch thread per rank, pinned to the first usable core (TP=1), in every mode,
    so ``ar``, ``sd`` and ``psd`` run the same target configuration and differ only in speculation.
    (Two OpenMP threads on a 2-core machine that also runs anything else slow a decode step down
    3-4x: spinning threads wait for the descheduled one.)"""
    args = ["-m", "verifier_svc", "--model", model_dir, *_engine_args(cfg, cfg.verifier_port, cfg.num_engine_threads),
            "--device", cfg.placement.verifier_device()]
    if cfg.bench_fixed_acceptance is not None:
        args += ["--bench-fixed-acceptance", repr(cfg.bench_fixed_acceptance)]
    if cfg.engine == "vllm":
        args += vllm_service_args(cfg, "verifier", model_dir)
    env = {**cfg.placement.verifier_env(), **(cfg.placement.verifier_mps_env() if cfg.uses_cuda_mps else {})}
    python = engine_python(cfg.engine, cfg.engine_python)
    if cfg.tensor_parallel_size > 1 and cfg.engine == "native":
        launcher = [python, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={cfg.tensor_parallel_size}"]
        return ServiceSpec("verifier", [*launcher, *args], f"{cfg.host}:{cfg.verifier_port}", env=env,
                           is_cuda_mps=cfg.uses_cuda_mps)
    return ServiceSpec("verifier", [python, *args], f"{cfg.host}:{cfg.verifier_port}",
                       _pinned(cfg, VERIFIER_CPU), env, cfg.uses_cuda_mps)


def drafter_spec(cfg: StackConfig, model_dir: str, draft_dir: str) -> ServiceSpec:
    """Drafter: pinned to core 1 with one thread."""
    argv = [engine_python(cfg.engine, cfg.engine_python), "-m", "drafter_svc", "--draft", draft_dir, "--model", model_dir,
            *_engine_args(cfg, cfg.drafter_port, cfg.num_engine_threads), "--device", cfg.placement.drafter_device()]
    if cfg.engine == "vllm":
        argv += vllm_service_args(cfg, "drafter", draft_dir)
    if cfg.draft_processes > 1:
        argv += ["--draft-processes", str(cfg.draft_processes)]
    cpus = _pinned(cfg, DRAFTER_CPU)
    return ServiceSpec("drafter", argv, f"{cfg.host}:{cfg.drafter_port}", cpus, cfg.placement.drafter_env(),
                       cfg.uses_cuda_mps)


def coordinator_spec(cfg: StackConfig) -> ServiceSpec:
    argv = [sys.executable, "-m", "coordinator", "--mode", cfg.mode,
            "--k", str(cfg.num_speculative_tokens),
            "--max-num-seqs", str(cfg.max_num_seqs), "--data-plane", _COORDINATOR_PLANE[cfg.data_plane],
            "--drafter", f"{cfg.host}:{cfg.drafter_port}", "--verifier", f"{cfg.host}:{cfg.verifier_port}",
            "--host", cfg.host, "--port", str(cfg.coordinator_port), "--metrics-port", str(cfg.metrics_port),
            "--k-policy", cfg.k_policy, "--balancer", cfg.balancer,
            "--max-num-batched-tokens", str(_batched_tokens(cfg)), "--max-queue-len", str(cfg.max_queue_len),
            "--grace", repr(cfg.grace_s), "--decode-steps", str(cfg.decode_steps),
            "--stream-decode-steps" if cfg.stream_decode_steps else "--no-stream-decode-steps",
            "--stream-interval", str(cfg.stream_interval), "--stream-interval-ms", str(cfg.stream_interval_ms)]
    if cfg.step_log:
        argv += ["--step-log", os.path.abspath(cfg.step_log)]
    return ServiceSpec("coordinator", argv, f"{cfg.host}:{cfg.coordinator_port}", env=cfg.placement.torch_free_env())


def _batched_tokens(cfg: StackConfig) -> int:
    if cfg.max_num_batched_tokens is not None:
        return cfg.max_num_batched_tokens
    return DEFAULT_BATCHED_TOKENS["cuda" if cfg.placement.is_cuda else "cpu"]


def gateway_spec(cfg: StackConfig, model_dir: str, draft_name: str) -> ServiceSpec:
    """The gateway's command line. Its ``--max-n`` is at most the coordinator's ``max_queue_len``:
    the ``best_of`` samples of a request are queued together, so a larger one could never be
    admitted (HTTP 400 / INVALID_ARGUMENT naming ``n`` or ``best_of`` instead of 429 forever)."""
    argv = [sys.executable, "-m", "gateway", "--tokenizer", model_dir,
            "--coordinator", f"{cfg.host}:{cfg.coordinator_port}", "--host", cfg.host,
            "--port", str(cfg.gateway_port), "--model-name", os.path.basename(os.path.normpath(cfg.target)),
            "--draft-name", draft_name, "--max-model-len", str(cfg.max_model_len),
            "--http-port", str(cfg.http_port), "--grace", repr(cfg.grace_s),
            "--max-n", str(min(DEFAULT_MAX_N, cfg.max_queue_len))]
    env = {**cfg.placement.torch_free_env(), **({"MINEDRAFT_API_KEY": cfg.api_key} if cfg.api_key else {})}
    return ServiceSpec("gateway", argv, f"{cfg.host}:{cfg.gateway_port}", env=env)


def build_service_specs(cfg: StackConfig, model_dir: str) -> list[ServiceSpec]:
    """Every service of the stack in start order: verifier, drafter (not in ``ar``), coordinator, gateway."""
    specs = [verifier_spec(cfg, model_dir)]
    draft_name = ""
    if cfg.has_drafter:
        draft_dir = resolve_draft_dir(cfg, model_dir)
        draft_name = os.path.basename(os.path.normpath(draft_dir))
        if cfg.bench_fixed_acceptance is not None:  # ListModels shows the benchmark-only label
            draft_name += f" [{fixed_acceptance_label(cfg.bench_fixed_acceptance)}]"
        specs.append(drafter_spec(cfg, model_dir, draft_dir))
    specs += [coordinator_spec(cfg), gateway_spec(cfg, model_dir, draft_name)]
    return specs
