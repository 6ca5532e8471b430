"""Coordinator configuration (frozen dataclass, validated in ``__post_init__``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.adaptive import KPolicy
from coordinator.balancer import BalancerPolicy

DEFAULT_PORT = 50052
DEFAULT_DRAFTER = "127.0.0.1:50053"
DEFAULT_VERIFIER = "127.0.0.1:50054"
MAX_PORT = 65535


class Mode(enum.StrEnum):
    """Step-loop mode: ``ar`` = target model alone (a verify step with k = 0); ``sd`` = standard
    speculative decoding (draft, then verify, one batch); ``psd`` = MineDraft batch-parallel SD
    (paper §5.1: two batches, drafting one while verifying the other)."""

    AR = "ar"
    SD = "sd"
    PSD = "psd"
    AUTO = "auto"  # per step, the best of ar / sd / psd by measured timings (coordinator.auto_mode)


class DataPlaneKind(enum.StrEnum):
    """How draft probabilities reach the verifier (DESIGN.md §4)."""

    INLINE = "inline"  # DraftResponse.draft_probs -> coordinator -> VerifyRequest.draft_probs
    DIST = "dist"  # torch.distributed drafter -> verifier; the coordinator passes step ids only

MAX_DECODE_STEPS = 64  # the verifier's limit of VerifyRequest.num_decode_steps
DEFAULT_STREAM_INTERVAL = 8  # decode steps per partial VerifyStream message (bench/results/engines_h200_s19)
DEFAULT_STREAM_INTERVAL_MS = 50  # ... or sooner, once this many ms passed (a 20-per-second stream on slow steps)
MAX_STREAM_INTERVAL_MS = 60_000
NO_TOKEN_BUDGET = 0  # max_num_batched_tokens: no limit on prompt tokens admitted per step


@dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of one coordinator process.

    Attributes:
        mode: ``ar``, ``sd``, ``psd`` or ``auto`` (chosen per step, ``coordinator.auto_mode``).
        num_speculative_tokens: k, draft tokens per request and step (>= 1).
        max_num_seqs: m, the batch size of one SD batch; at most ``2m`` requests run in ``psd``,
            ``m`` in ``ar``/``sd`` (further capped by the engines' free slots).
        drafter, verifier: ``host:port`` of drafter_svc and verifier_svc (rank 0).
        host, port: where the coordinator's gRPC server listens.
        data_plane: ``inline`` or ``dist``.
        max_queue_len: most waiting (not yet admitted) requests; more are refused with
            RESOURCE_EXHAUSTED.
        drafter_retry_s: seconds between probes of an unavailable drafter (while in ``ar`` fallback).
        rpc_timeout_s: deadline of each engine RPC (seconds).
        engine_wait_s: seconds to wait at start-up for both engines to report SERVING.
        grace_s: seconds in-flight requests get to finish on SIGTERM.
        metrics_port: port of the Prometheus ``/metrics`` HTTP endpoint; 0 = off.
        step_log: path of a JSONL file getting one record per step (``coordinator.tracing.StepLog``,
            read by ``minedraft timeline``); "" = off.
        k_policy: ``fixed`` (k = ``num_speculative_tokens`` always) or ``adaptive`` (k in
            [1, num_speculative_tokens] toward t_draft = t_verify, per-request switch-off;
            ``coordinator.adaptive``).
        balancer: ``paper`` (new requests join ``skip_batch`` after the first step, MineDraft §5.1)
            or ``feedback`` (keeps balancing by expected step cost; ``coordinator.balancer``).
        max_num_batched_tokens: most prompt tokens admitted (prefilled) between two steps, as
            vLLM's scheduler budget of the same name; the queue's head is always admitted, however
            long. Smaller budgets stream first tokens sooner and let running requests decode
            between admissions. :data:`NO_TOKEN_BUDGET` (0): no limit.
        num_decode_steps: tokens per request and Verify call when a step runs ``ar`` (multi-step
            decoding, as vLLM V0's ``--num-scheduler-steps``): the verifier decodes that many in
            one call, saving a coordinator round trip per token. 1: one per call.
        stream_decode_steps: a multi-step call's tokens reach the streams as its steps decode
            them (``Verifier.VerifyStream``), so a request that finishes inside the call ends
            then, not at the call's end; False: the whole call's tokens come at its end (unary
            ``Verify``, one chunk per call).
        stream_interval: with ``stream_decode_steps``, the verifier sends a partial message every
            this many decode steps (``VerifyRequest.stream_interval``; vLLM's ``--stream-interval``):
            fewer, larger chunks through the coordinator and the gateway at high concurrency, at
            most this many steps of delay for a request that finishes inside the call. 1: every step.
        stream_interval_ms: ... or sooner, once this many ms passed since the last partial
            message (``VerifyRequest.stream_interval_ms``): where a decode step is slow (a large
            model, a CPU) a stream still moves about every this many ms instead of every
            ``stream_interval`` steps. 0: steps only.
    """

    mode: Mode = Mode.PSD
    num_speculative_tokens: int = 4
    max_num_seqs: int = 8
    drafter: str = DEFAULT_DRAFTER
    verifier: str = DEFAULT_VERIFIER
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    data_plane: DataPlaneKind = DataPlaneKind.INLINE
    max_queue_len: int = 1024
    drafter_retry_s: float = 2.0
    rpc_timeout_s: float = 120.0
    engine_wait_s: float = 600.0
    grace_s: float = 5.0
    metrics_port: int = 0
    step_log: str = ""
    k_policy: str = "fixed"
    balancer: str = "paper"
    max_num_batched_tokens: int = 0
    num_decode_steps: int = 1
    stream_decode_steps: bool = True
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    stream_interval_ms: int = DEFAULT_STREAM_INTERVAL_MS

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _enum_field("mode", Mode, self.mode))
        object.__setattr__(self, "data_plane", _enum_field("data_plane", DataPlaneKind, self.data_plane))
        object.__setattr__(self, "k_policy", _enum_field("k_policy", KPolicy, self.k_policy))
        object.__setattr__(self, "balancer", _enum_field("balancer", BalancerPolicy, self.balancer))
        _require(self.num_speculative_tokens >= 1, "num_speculative_tokens", "must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        for name in ("drafter", "verifier"):
            _require(":" in getattr(self, name), name, "expected host:port")
        _require(bool(self.host), "host", "must not be empty")
        _require(0 <= self.port <= MAX_PORT, "port", f"must be in [0, {MAX_PORT}]")
        _require(self.max_queue_len >= 1, "max_queue_len", "must be >= 1")
        for name in ("drafter_retry_s", "rpc_timeout_s", "engine_wait_s"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.grace_s >= 0, "grace_s", "must be >= 0")
        _require(self.max_num_batched_tokens >= NO_TOKEN_BUDGET, "max_num_batched_tokens",
                 f"must be >= {NO_TOKEN_BUDGET} ({NO_TOKEN_BUDGET} = no limit)")
        _require(1 <= self.num_decode_steps <= MAX_DECODE_STEPS, "num_decode_steps",
                 f"must be in [1, {MAX_DECODE_STEPS}]")
        _require(1 <= self.stream_interval <= MAX_DECODE_STEPS, "stream_interval", f"must be in [1, {MAX_DECODE_STEPS}]")
        _require(0 <= self.stream_interval_ms <= MAX_STREAM_INTERVAL_MS, "stream_interval_ms",
                 f"must be in [0, {MAX_STREAM_INTERVAL_MS}]")
        _require(0 <= self.metrics_port <= MAX_PORT, "metrics_port", f"must be in [0, {MAX_PORT}] (0 = off)")

    @property
    def max_num_running(self) -> int:
        """Most requests running at once: 2m in ``psd`` and ``auto`` (two batches), m otherwise."""
        return 2 * self.max_num_seqs if self.uses_batches else self.max_num_seqs

    @property
    def uses_batches(self) -> bool:
        """Whether running requests are kept in the Batch Manager's two batches (``psd``, ``auto``)."""
        return self.mode in (Mode.PSD, Mode.AUTO)

    @property
    def uses_drafter(self) -> bool:
        """Whether the mode drafts at all (``sd`` and ``psd``)."""
        return self.mode != Mode.AR


def _enum_field(name: str, enum_type: type[enum.StrEnum], value: object) -> enum.StrEnum:
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(m.value for m in enum_type)
        raise ValueError(f"{name}: must be one of {choices}, got {value!r}") from None


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field}: {message}")
