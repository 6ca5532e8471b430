"""The systems of ``bench.engines.engines_compare``: our stack on either engine backend, vLLM's own server.

Names: ``<mode>-<engine>[-ds<N>][-si<S>|-block][-ms<T>][-adaptive][-ses|-prop][-dp<D>][-vsm<P>]`` for ours (mode
``ar``/``sd``/``psd``/``auto``, engine ``vllm`` or ``native``; ``-ds<N>``: ``--decode-steps N`` for
this system, else the run's; ``-si<S>``: ``--stream-interval S`` (else the default); ``-block``:
``--no-stream-decode-steps``, a multi-step call's tokens at its end; ``-ms<T>``:
``--stream-interval-ms T`` (0: partial messages by steps only); ``-adaptive``: ``--k-policy
adaptive``, which ``auto`` always runs; ``-ses``: ``--draft-sessions``, the vLLM drafter's resident
draft requests; ``-prop``: ``--draft-proposer``, one engine step per draft call; ``-dp<D>``:
``--draft-processes D``, the drafter's engine as D processes; ``-vsm<P>``: ``--cuda-mps-verifier-sm-percent P``), ``vllm-ar`` and
``vllm-sd-k<K>`` for vLLM. A trailing ``-v1`` on any name runs its vLLM engines on vLLM's V1 model
runner (``VLLM_USE_V2_MODEL_RUNNER=0``), where vLLM 0.24 puts every engine with a ``custom_class``
or ``draft_model`` speculative method (our sd / psd / auto verifier, vLLM's SD) while plain decoding
runs on Model Runner V2: ``vllm-ar`` beside ``vllm-ar-v1`` measures what V1 costs. Start/stop and metrics are those of
``bench.common.systems.OursSystem`` / ``VllmSystem`` (subclassed: only the command lines differ).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from unittest import mock

from bench.common.systems import Endpoint, OursSystem, VllmSystem
from coordinator.config import DEFAULT_STREAM_INTERVAL, DEFAULT_STREAM_INTERVAL_MS, MAX_STREAM_INTERVAL_MS
from minedraft.engine_backend import ENGINES, OWN_GPU_UTILIZATION, engine_python

OUR_MODES = ("ar", "sd", "psd", "auto")
_VLLM = re.compile(r"^vllm-(?:(?P<ar>ar)|sd-k(?P<k>\d+))(?P<v1>-v1)?$")
_OURS = re.compile(r"^(?P<mode>[a-z]+)-(?P<engine>[a-z]+)(?:-ds(?P<ds>\d+))?(?:-si(?P<si>\d+)|(?P<block>-block))?"
                   r"(?:-ms(?P<ms>\d+))?(?P<adaptive>-adaptive)?(?:(?P<ses>-ses)|(?P<prop>-prop))?(?:-dp(?P<dp>\d+))?(?:-vsm(?P<vsm>\d+))?(?P<v1>-v1)?$")
SERVED_MODEL = "minedraft-bench-target"


@dataclass(frozen=True)
class SystemName:
    family: str            # "ours" or "vllm"
    mode: str              # ours: ar/sd/psd/auto; vLLM: ar/sd
    engine: str = ""       # ours: vllm/native
    k: int | None = None   # vLLM sd: num_speculative_tokens
    decode_steps: int | None = None  # ours: --decode-steps of this system (None: the run's)
    stream_decode_steps: bool = True  # ours: False for -block (--no-stream-decode-steps)
    stream_interval: int | None = None  # ours: --stream-interval of this system (None: the default)
    stream_interval_ms: int | None = None  # ours: --stream-interval-ms of this system (None: the default)
    adaptive_k: bool = False  # ours: --k-policy adaptive (auto: always)
    verifier_sm_percent: int = 100  # ours: --cuda-mps-verifier-sm-percent
    draft_sessions: bool = False  # ours: --draft-sessions
    draft_proposer: bool = False  # ours: --draft-proposer
    draft_processes: int = 1  # ours: --draft-processes
    model_runner_v1: bool = False  # -v1: the vLLM engines on vLLM's V1 model runner

    @property
    def engine_env(self) -> dict[str, str]:
        """Environment the system's vLLM engines start with (``-v1``: ``VLLM_USE_V2_MODEL_RUNNER=0``)."""
        return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if self.model_runner_v1 else {}


def parse_system(name: str) -> SystemName:
    """``SystemName`` of a system label. Raises ValueError naming it when it is none of the forms."""
    match = _VLLM.match(name)
    if match and (match.group("ar") or int(match.group("k")) >= 1):
        k = None if match.group("ar") else int(match.group("k"))
        return SystemName("vllm", "ar" if k is None else "sd", k=k, model_runner_v1=match.group("v1") is not None)
    ours = _OURS.match(name)
    counts = [int(ours.group(g)) for g in ("ds", "si") if ours.group(g) is not None] if ours else []
    vsm = int(ours.group("vsm")) if ours and ours.group("vsm") else 100
    ms = int(ours.group("ms")) if ours and ours.group("ms") else None
    dp = int(ours.group("dp")) if ours and ours.group("dp") else 1
    if (ours and ours.group("mode") in OUR_MODES and ours.group("engine") in ENGINES and all(1 <= n <= 64 for n in counts)
            and 1 <= vsm <= 100 and (ms is None or ms <= MAX_STREAM_INTERVAL_MS) and 1 <= dp <= 64):
        return SystemName("ours", ours.group("mode"), ours.group("engine"),
                          decode_steps=int(ours.group("ds")) if ours.group("ds") else None,
                          stream_decode_steps=ours.group("block") is None,
                          stream_interval=int(ours.group("si")) if ours.group("si") else None, stream_interval_ms=ms,
                          adaptive_k=ours.group("adaptive") is not None or ours.group("mode") == "auto",
                          verifier_sm_percent=vsm, draft_sessions=ours.group("ses") is not None,
                          draft_proposer=ours.group("prop") is not None, draft_processes=dp,
                          model_runner_v1=ours.group("v1") is not None)
    raise ValueError(f"systems: unknown system {name!r} (forms: vllm-ar[-v1], vllm-sd-k<K>[-v1], "
                     f"<{'|'.join(OUR_MODES)}>-<{'|'.join(ENGINES)}>[-ds<N>][-si<S>|-block][-ms<T>][-adaptive][-ses|-prop][-dp<D>][-vsm<P>][-v1], "
                     f"N, S and D in [1, 64], T in [0, {MAX_STREAM_INTERVAL_MS}], P in [1, 100])")


def synthetic_rates(p: float, k: int) -> list[float]:
    """vLLM's per-position unconditional acceptance rates for our fixed acceptance P: P^1..P^k."""
    return [p ** i for i in range(1, k + 1)]


def our_stack_config(system: SystemName, cfg, logs_dir: str, step_log: str):
    """The ``minedraft.stack.StackConfig`` of our ``system`` under ``cfg`` (free loopback ports)."""
    from minedraft.stack import StackConfig, free_loopback_ports

    gateway, coordinator, drafter, verifier, dist, http = free_loopback_ports(6)
    is_cuda = cfg.device == "cuda"
    two_batches = system.mode in ("psd", "auto")
    return StackConfig(
        mode=system.mode, engine=system.engine, engine_python=cfg.vllm_python, num_speculative_tokens=cfg.k,
        max_num_seqs=cfg.m if two_batches else 2 * cfg.m, target=cfg.target, draft=cfg.draft,
        max_model_len=cfg.max_model_len, dtype=cfg.dtype, device=cfg.device,
        drafter_gpu=cfg.drafter_gpu if is_cuda else -1, cuda_mps=cfg.cuda_mps and is_cuda,
        verifier_sm_percent=system.verifier_sm_percent, draft_sessions=system.draft_sessions,
        draft_proposer=system.draft_proposer, draft_processes=system.draft_processes,
        bench_fixed_acceptance=cfg.fixed_acceptance, enforce_eager=cfg.enforce_eager,
        k_policy="adaptive" if system.adaptive_k else "fixed",
        balancer="feedback" if system.mode == "auto" else "paper",
        data_plane="inline" if system.engine == "vllm" or not is_cuda else "ipc",
        gateway_port=gateway, coordinator_port=coordinator, drafter_port=drafter, verifier_port=verifier,
        dist_port=dist, http_port=http, step_log=step_log, runs_dir=logs_dir,
        startup_timeout_s=cfg.startup_timeout_s,
        num_decode_steps=cfg.decode_steps if system.decode_steps is None else system.decode_steps,
        stream_decode_steps=system.stream_decode_steps,
        stream_interval=system.stream_interval or DEFAULT_STREAM_INTERVAL,
        stream_interval_ms=DEFAULT_STREAM_INTERVAL_MS if system.stream_interval_ms is None else system.stream_interval_ms)


class OursServer(OursSystem):
    """Our stack for ``name`` under ``cfg`` (a ``bench.engines.engines_compare.CompareConfig``)."""

    def __init__(self, name: str, cfg, logs_dir: str) -> None:  # noqa: D107 -- see the class docstring
        from minedraft.launcher import Stack, resolve_model_dir

        os.makedirs(logs_dir, exist_ok=True)
        self._step_log = os.path.join(logs_dir, "steps.jsonl")
        system = parse_system(name)
        stack = our_stack_config(system, cfg, logs_dir, self._step_log)
        self._stack = Stack(stack, run_dir=logs_dir)
        self._model_dir = resolve_model_dir(cfg.target)
        self._engine_env = system.engine_env
        self.endpoint = Endpoint(f"http://127.0.0.1:{stack.http_port}/v1", os.path.basename(os.path.normpath(cfg.target)),
                                 self._step_log, logs_dir)

    def __enter__(self) -> Endpoint:
        """Starts the stack with ``engine_env`` in the environment its services inherit."""
        with mock.patch.dict(os.environ, self._engine_env):
            return super().__enter__()


def vllm_server_argv(python: str, cfg, system: SystemName, port: int, target: tuple[str, str],
                     draft: tuple[str, str] | None) -> list[str]:
    """vLLM's OpenAI server command line for ``system``; ``target``/``draft``: (HF dir, load format)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target[0], "--served-model-name",
            SERVED_MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(2 * cfg.m),
            "--max-model-len", str(cfg.max_model_len), "--dtype", cfg.dtype, "--seed", "0",
            "--load-format", target[1]]
    if cfg.device == "cuda":
        argv += ["--gpu-memory-utilization", str(OWN_GPU_UTILIZATION)]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if system.mode == "sd":
        spec = {"method": "draft_model", "model": draft[0], "num_speculative_tokens": system.k}
        if cfg.fixed_acceptance is not None:
            spec.update(rejection_sample_method="synthetic",
                        synthetic_acceptance_rates=synthetic_rates(cfg.fixed_acceptance, system.k))
        argv += ["--speculative-config", json.dumps(spec)]
    return argv


class VllmServer(VllmSystem):
    """vLLM's OpenAI server for ``name`` under ``cfg`` (GPU or the CPU build)."""

    def __init__(self, name: str, cfg, logs_dir: str) -> None:  # noqa: D107 -- see the class docstring
        from minedraft.launcher import resolve_model_dir
        from minedraft.stack import StackConfig, free_loopback_ports, resolve_draft_dir
        from specdec.vllm_backend.engine import CUDA_ENV_DEFAULTS, ENV_DEFAULTS
        from specdec.vllm_backend.models import resolve_vllm_model

        system = parse_system(name)
        (port,) = free_loopback_ports(1)
        os.makedirs(logs_dir, exist_ok=True)
        target = resolve_vllm_model(cfg.target)
        draft = None
        if system.mode == "sd":
            target_dir = resolve_model_dir(cfg.target)
            draft = resolve_vllm_model(resolve_draft_dir(StackConfig(target=cfg.target, draft=cfg.draft), target_dir),
                                       target_dir)
        python = cfg.vllm_python or engine_python("vllm")
        self.argv = vllm_server_argv(python, cfg, system, port, target, draft)
        self._env = {**os.environ, **ENV_DEFAULTS, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        if cfg.device == "cuda":
            self._env.update(CUDA_ENV_DEFAULTS)
        else:
            self._env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        self._env.update(system.engine_env)
        self._log_path = os.path.join(logs_dir, "vllm.log")
        self._timeout_s = cfg.startup_timeout_s
        self._root = f"http://127.0.0.1:{port}"
        self._process = None
        self.endpoint = Endpoint(f"{self._root}/v1", SERVED_MODEL, "", logs_dir)

