"""Request and step tracing of the coordinator (OpenTelemetry spans, the JSONL step log; torch-free).

Trace layout (docs/METRICS.md):
- Each request has its own trace: gateway ``gateway.generate`` -> gRPC client/server spans ->
  ``coordinator.request`` (from submit to finish: queue wait, TTFT, token counts, finish_reason).
- The step loop is shared by up to 2m requests, so a step cannot be a child of one request.
  Each ``coordinator.step`` span is the root of its own trace and carries a span *link* to the
  ``coordinator.request`` span of every request it verified or drafted (the OpenTelemetry
  pattern for batch work), plus their ids in ``minedraft.request_ids``. The engine RPCs of the
  step (Draft, Verify) are its children, and so are the services' spans for forward passes,
  sampling and the data plane. In Jaeger a step's span shows its requests under
  "References"; search ``minedraft.request_ids`` or ``minedraft.step_id`` tags to find steps.

``StepLog`` writes one JSON line per step (``--step-log PATH``): the ``StepStats`` fields plus
wall-clock phase intervals, which ``minedraft timeline`` draws.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import IO

from opentelemetry import trace

from minedraft.telemetry import tracer
from coordinator.stats import StepStats

_ATTR = "minedraft."


@dataclass(frozen=True)
class Phase:
    """One engine call inside a step, for the timeline.

    Attributes:
        engine: "drafter" or "verifier".
        batch: PSD batch index (0 or 1); 0 in ``ar``/``sd``.
        start_s: wall-clock start of the RPC (Unix seconds).
        compute_ms: compute time the engine reported (draft_ms / verify_ms).
        rpc_ms: wall time of the RPC measured at the coordinator.
        num_requests: requests in the call.
        service_ms: the engine service's wall time on the call (its response's ``service_ms``;
            0 from a service that does not report it); ``rpc_ms - service_ms`` is gRPC transport
            and the coordinator's client, ``service_ms - compute_ms`` the service's own share.
        sent_s: when the RPC itself was sent (Unix s; ``start_s`` is earlier by the request's
            building); service_start_s: when the service's handler started (Unix s; 0: not
            reported). ``service_start_s - sent_s`` is the request's transport (one host, one clock).
        core_ms, core_steps: a vLLM verifier's time in vLLM's engine-core steps and their number
            (``VerifyResponse.engine_core_ms`` / ``num_engine_steps``; 0: not reported);
            ``compute_ms - core_ms`` is its worker's own work around them.
    """

    engine: str
    batch: int
    start_s: float
    compute_ms: float
    rpc_ms: float
    num_requests: int
    service_ms: float = 0.0
    sent_s: float = 0.0
    service_start_s: float = 0.0
    core_ms: float = 0.0
    core_steps: int = 0


@dataclass
class StepTrace:
    """The span of the step being run (``start_step``, ``add_requests``, then ``finish_step``)."""

    span: trace.Span
    start_s: float
    request_ids: list[str] = field(default_factory=list)

    def add_requests(self, requests) -> None:
        """Link the step to the ``coordinator.request`` spans of ``requests`` (``RequestState``s)."""
        self.request_ids += [request.request_id for request in requests]
        if self.span.is_recording():  # tracing off: skip the link bookkeeping
            for request in requests:
                if request.trace is not None:
                    self.span.add_link(request.trace.span.get_span_context())


class RequestTrace:
    """The ``coordinator.request`` span of one request and its latency marks.

    Times: ``time.perf_counter()`` seconds, from the coordinator's receipt of the request.
    With ``metrics`` (a ``CoordinatorMetrics``) it also counts prompt tokens and observes the TTFT,
    inter-token (per token of a step's chunk) and end-to-end latency histograms (generation
    tokens: ``coordinator.emitted``).
    """

    def __init__(self, request_id: str, num_prompt_tokens: int, metrics=None) -> None:
        self.metrics = metrics  # a CoordinatorMetrics, or None
        self.arrival_s = time.perf_counter()
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.span = tracer().start_span("coordinator.request", attributes={
            f"{_ATTR}request_id": request_id, f"{_ATTR}prompt_tokens": num_prompt_tokens})
        if metrics is not None:
            metrics.num_prompt_tokens.inc(num_prompt_tokens)

    def on_admit(self) -> None:
        self.admitted_s = time.perf_counter()
        self.span.set_attribute(f"{_ATTR}queue_wait_ms", (self.admitted_s - self.arrival_s) * 1e3)

    def on_tokens(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` streamed now (TTFT on the first call, else inter-token latency)."""
        now = time.perf_counter()
        previous, self.last_token_s = self.last_token_s, now
        if previous is None:
            self.first_token_s = now
            self.span.set_attribute(f"{_ATTR}ttft_ms", (now - self.arrival_s) * 1e3)
            if self.metrics is not None:
                self.metrics.ttft_seconds.observe(now - self.arrival_s)
        elif self.metrics is not None:
            for _ in range(num_tokens):
                self.metrics.inter_token_seconds.observe((now - previous) / max(num_tokens, 1))

    def end(self, finish_reason: str, usage) -> None:
        """End the span with the finish reason ("error" for a failed request) and the token counts
        (a ``common_pb2.Usage``)."""
        e2e_s = time.perf_counter() - self.arrival_s
        if self.metrics is not None:
            self.metrics.e2e_seconds.observe(e2e_s)
            self.metrics.num_requests_finished.labels(finish_reason=finish_reason).inc()
        self.span.set_attributes({
            f"{_ATTR}finish_reason": finish_reason, f"{_ATTR}e2e_ms": e2e_s * 1e3,
            f"{_ATTR}completion_tokens": usage.completion_tokens, f"{_ATTR}num_drafts": usage.num_drafts,
            f"{_ATTR}drafted_tokens": usage.num_draft_tokens, f"{_ATTR}accepted_tokens": usage.num_accepted_tokens})
        if finish_reason == "error":
            self.span.set_status(trace.StatusCode.ERROR)
        self.span.end()


def start_step(step_id: int) -> StepTrace:
    """Open the ``coordinator.step`` span as the root of a new trace."""
    span = tracer().start_span("coordinator.step", context=trace.set_span_in_context(trace.INVALID_SPAN),
                               attributes={f"{_ATTR}step_id": step_id})
    return StepTrace(span, time.time())


def finish_step(step: StepTrace, stats: StepStats, phases: list[Phase]) -> None:
    """Set the ``StepStats`` fields (``minedraft.<field>``) and the request ids, add one ``phase``
    event per engine call (at its start; attributes = the ``Phase`` fields), end the span."""
    if not step.span.is_recording():  # tracing off (no-op span): nothing to build
        return
    step.span.set_attributes({f"{_ATTR}{key}": value for key, value in asdict(stats).items()})
    for phase in phases:
        step.span.add_event("phase", attributes=asdict(phase), timestamp=int(phase.start_s * 1e9))
    step.span.set_attribute(f"{_ATTR}request_ids", step.request_ids)
    step.span.end()


class StepLog:
    """Appends one JSON object per step to ``path``: ``StepStats`` fields, ``start_s`` (Unix s),
    ``request_ids`` and ``phases`` (list of ``Phase`` dicts). Line-buffered, so a crash keeps
    every finished step."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, step: StepTrace, stats: StepStats, phases: list[Phase]) -> None:
        record = {**asdict(stats), "start_s": step.start_s, "request_ids": step.request_ids,
                  "phases": [asdict(p) for p in phases]}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
