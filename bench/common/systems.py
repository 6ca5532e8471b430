"""The systems the benchmark suite compares, and how each one is started and stopped (issue 8).

Ours (gateway's OpenAI-compatible HTTP API, stack started with ``minedraft.launcher.Stack``):
- ``ar``: target alone, verifier pinned to one core, max_num_seqs = 2m;
- ``sd``: standard speculative decoding, verifier/drafter pinned to cores 0/1, max_num_seqs = 2m;
- ``psd``: MineDraft, two batches of m (2m resident), verifier/drafter pinned to cores 0/1;
- ``sd-2core``: ``sd`` given the same hardware as ``psd`` differently: no pinning, both engines
  with 2 torch threads each, max_num_seqs = 2m;
- ``psd-adaptive``: ``psd`` with adaptive k (issue 10); ``auto``: per-step choice of ar/sd/psd with
  adaptive k and the feedback balancer, m per batch (2m resident).
vLLM CPU build (``.venv-vllm``, OpenAI API server as a subprocess, max_num_seqs = 2m):
- ``vllm-ar``: no speculation; ``vllm-sd``: ``draft_model`` speculation with our exported draft
  (``bench.engines.export_hf``: full-vocabulary head, see there); ``vllm-ngram``: n-gram speculation
  (extra peer, no draft model).
Every system therefore keeps 2m requests resident at concurrency 2m.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

OURS, VLLM = "ours", "vllm"
NO_METRICS: dict[str, float] = {}
AUTO_DTYPE = "auto"  # bench dtype: bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX), else float32
BENCH_DTYPES = ("float32", "bfloat16")
VLLM_SPEC_COUNTERS = {"num_drafts": "vllm:spec_decode_num_drafts", "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                      "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


@dataclass(frozen=True)
class SystemSpec:
    """One benchmarked system.

    Attributes:
        name: label in every output (``ar``, ``sd``, ``psd``, ``sd-2core``, ``vllm-ar``, ...).
        family: ``ours`` or ``vllm``.
        mode: ours: ``ar``/``sd``/``psd``; vLLM: ``ar`` (none), ``sd`` (draft model), ``ngram``.
        is_pinned: ours: verifier/drafter pinned to one core each.
        num_engine_threads: ours: torch threads per engine.
        max_num_batched_tokens: ours: the coordinator's prompt-token budget per step (0 = none,
            None = the stack's device default, ``minedraft.stack.DEFAULT_BATCHED_TOKENS``).
        note: caveat printed with the results.
    """

    name: str
    family: str
    mode: str
    is_pinned: bool = True
    num_engine_threads: int = 1
    k_policy: str = "fixed"
    balancer: str = "paper"
    max_num_batched_tokens: int | None = None
    note: str = ""

    @property
    def is_speculative(self) -> bool:
        return self.mode != "ar"

    def max_num_seqs(self, m: int) -> int:
        """Requests per batch so that 2m stay resident: m for psd (two batches), else 2m."""
        return m if self.mode in ("psd", "auto") else 2 * m

    def num_cores(self, num_usable: int, vllm_reserved_cpus: int) -> int:
        """CPU cores the system's engines use (for tokens/s per core)."""
        if self.family == VLLM:
            return max(num_usable - vllm_reserved_cpus, 1)
        return 1 if self.mode == "ar" else min(2, num_usable)


NO_TOKEN_LIMIT = 0  # max_num_batched_tokens: admit every waiting prompt at once

SYSTEMS = {s.name: s for s in (
    SystemSpec("ar", OURS, "ar", note="verifier pinned to 1 core"),
    SystemSpec("sd", OURS, "sd", note="verifier and drafter pinned to cores 0/1"),
    SystemSpec("psd", OURS, "psd", note="two batches of m (2m resident), verifier/drafter pinned to cores 0/1"),
    SystemSpec("ar-nolimit", OURS, "ar", max_num_batched_tokens=NO_TOKEN_LIMIT,
               note="ar admitting every waiting prompt at once (no --max-num-batched-tokens; ar uses the "
                    "stack's default)"),
    SystemSpec("sd-2core", OURS, "sd", is_pinned=False, num_engine_threads=2,
               note="sd with both cores: no pinning, 2 torch threads per engine"),
    SystemSpec("psd-adaptive", OURS, "psd", k_policy="adaptive",
               note="psd with adaptive k (k per batch toward t_draft = t_verify, at most --k)"),
    SystemSpec("auto", OURS, "auto", k_policy="adaptive", balancer="feedback",
               note="per-step choice of ar/sd/psd, adaptive k, feedback balancer; 2m resident"),
    SystemSpec("vllm-ar", VLLM, "ar", note="vLLM CPU build, no speculation"),
    SystemSpec("vllm-sd", VLLM, "sd", note="vLLM draft_model speculation; its draft uses the FULL vocabulary head "
                                           "(ours: FR-Spec 16384-id head)"),
    SystemSpec("vllm-ngram", VLLM, "ngram", note="EXTRA PEER: vLLM n-gram speculation (no draft model)"),
)}


@dataclass
class Endpoint:
    """A running system: OpenAI base URL, served model id, our step log ("" for vLLM), logs dir."""

    base_url: str
    model: str
    step_log: str
    logs: str


def fetch_text(url: str, timeout_s: float = 5.0) -> str | None:
    """GET ``url`` as text; None when it does not answer 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", "replace") if response.status == 200 else None
    except OSError:
        return None


def vllm_spec_counters(metrics_text: str | None) -> dict[str, float]:
    """Sum of each vLLM spec-decode counter (``VLLM_SPEC_COUNTERS``) over its label sets in a
    Prometheus text page; {} when the page is None. Counters vLLM does not export count 0."""
    if metrics_text is None:
        return dict(NO_METRICS)
    totals = {key: 0.0 for key in VLLM_SPEC_COUNTERS}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        for key, name in VLLM_SPEC_COUNTERS.items():
            if line.startswith((name + "_total", name + "{", name + " ")):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def resolve_bench_dtype(dtype: str) -> str:
    """The dtype both ours and vLLM run in: ``dtype`` itself, or for ``auto`` bfloat16 when the
    CPU has native bf16 matmuls (AVX512-BF16 or AMX; bench.cpu.cpu_step measured bf16 steps ~1.5x
    faster at batch >= 4 there) and float32 otherwise. bf16 greedy outputs of sd/psd may differ
    from ar's at near-ties (bench/results/cpu_step_identity_bfloat16.json).

    Raises:
        ValueError: ``dtype`` is not ``auto`` or one of ``BENCH_DTYPES``.
    """
    if dtype == AUTO_DTYPE:
        import torch

        has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return "bfloat16" if has_bf16 and torch.backends.mkldnn.is_available() else "float32"
    if dtype not in BENCH_DTYPES:
        raise ValueError(f"dtype must be {AUTO_DTYPE!r} or one of {BENCH_DTYPES}, got {dtype!r}")
    return dtype


class OursSystem:
    """Our stack (verifier, drafter, coordinator, gateway with HTTP API) as a context manager."""

    def __init__(self, spec: SystemSpec, model_dir: str, target: str, draft: str, m: int, k: int,
                 max_model_len: int, logs_dir: str, startup_timeout_s: float = 900.0,
                 dtype: str = "float32") -> None:
        from minedraft.launcher import Stack
        from minedraft.stack import StackConfig, free_loopback_ports

        gateway, coordinator, drafter, verifier, dist, http = free_loopback_ports(6)
        os.makedirs(logs_dir, exist_ok=True)
        self._step_log = os.path.join(logs_dir, "steps.jsonl")
        cfg = StackConfig(mode=spec.mode, num_speculative_tokens=k, max_num_seqs=spec.max_num_seqs(m), target=target,
                          draft=draft, max_model_len=max_model_len, is_pinned=spec.is_pinned,
                          num_engine_threads=spec.num_engine_threads, k_policy=spec.k_policy,
                          balancer=spec.balancer, max_num_batched_tokens=spec.max_num_batched_tokens,
                          gateway_port=gateway,
                          coordinator_port=coordinator, drafter_port=drafter, verifier_port=verifier, dist_port=dist,
                          http_port=http, step_log=self._step_log, runs_dir=logs_dir,
                          startup_timeout_s=startup_timeout_s, dtype=dtype)
        self._stack = Stack(cfg, run_dir=logs_dir)
        self._model_dir = model_dir
        self.endpoint = Endpoint(f"http://127.0.0.1:{http}/v1", os.path.basename(os.path.normpath(target)),
                                 self._step_log, logs_dir)

    start_deadline: float | None = None  # time.monotonic() by which the start-up must be done (a time budget)

    def __enter__(self) -> Endpoint:
        try:
            self._stack.start(self._model_dir, log=lambda msg: None, deadline=self.start_deadline)
        except BaseException:
            self._stack.stop()
            raise
        return self.endpoint

    def __exit__(self, *exc) -> None:
        self._stack.stop()

    def metrics(self) -> dict[str, float]:
        return dict(NO_METRICS)


class VllmSystem:
    """``python -m vllm.entrypoints.openai.api_server`` from ``.venv-vllm`` as a context manager.

    Args:
        python: the vLLM environment's interpreter (``.venv-vllm/bin/python``).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; the CPU build's memory knob).
        reserved_cpus: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (cores left to the API server).
        extra_args: appended to the server's command line (e.g. ``-O0`` to skip compilation).
        dtype: ``--dtype`` of the server (the suite passes the same dtype to ours).
    Raises (on enter):
        RuntimeError: the server exited or was not healthy within ``startup_timeout_s`` (or by
            ``start_deadline``, when set).
    """

    start_deadline: float | None = None  # time.monotonic() by which the start-up must be done (a time budget)

    def __init__(self, spec: SystemSpec, python: str, target_dir: str, draft_dir: str, m: int, k: int,
                 max_model_len: int, logs_dir: str, kv_cache_gib: int = 4, reserved_cpus: int = 1,
                 startup_timeout_s: float = 900.0, extra_args: tuple[str, ...] = (),
                 dtype: str = "float32") -> None:
        from minedraft.stack import free_loopback_ports

        (port,) = free_loopback_ports(1)
        os.makedirs(logs_dir, exist_ok=True)
        self._log_path = os.path.join(logs_dir, "vllm.log")
        self._timeout_s = startup_timeout_s
        self._root = f"http://127.0.0.1:{port}"
        model = "minedraft-bench-target"
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir, "--served-model-name",
                model, "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(spec.max_num_seqs(m)),
                "--max-model-len", str(max_model_len), "--dtype", dtype, "--seed", "0"]
        speculative = {"sd": {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k},
                       "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                 "prompt_lookup_min": 2}}.get(spec.mode)
        if speculative is not None:
            argv += ["--speculative-config", json.dumps(speculative)]
        self.argv = argv + list(extra_args)
        self._env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                     "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus), "VLLM_NO_USAGE_STATS": "1",
                     "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self._process: subprocess.Popen | None = None
        self.endpoint = Endpoint(f"{self._root}/v1", model, "", logs_dir)

    def __enter__(self) -> Endpoint:
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen([sys.executable, "-m", "minedraft.child_exec", "-", "--", *self.argv],
                                             stdout=log, stderr=subprocess.STDOUT, env=self._env,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = min(time.monotonic() + self._timeout_s, self.start_deadline or float("inf"))
        while fetch_text(f"{self._root}/health") is None:
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"vLLM server not healthy (see {self._log_path}):\n{_tail(self._log_path)}")
            time.sleep(1.0)
        return self.endpoint

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self._process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self._process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._process = None

    def metrics(self) -> dict[str, float]:
        """vLLM's spec-decode counters now (see ``vllm_spec_counters``)."""
        return vllm_spec_counters(fetch_text(f"{self._root}/metrics"))


def _tail(path: str, num_lines: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])
    except OSError:
        return ""
