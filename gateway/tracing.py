"""The gateway's request span ``gateway.generate`` (OpenTelemetry; torch-free).

One span per Generate request (gRPC or HTTP front end), the root of the request's trace when
the client sent no ``traceparent``, else a child of the server span. The coordinator
``Generate`` call is made inside it, so the coordinator's spans join the same trace
(``coordinator.tracing``). Attributes (``minedraft.*``): request_id, prompt_tokens, ttft_ms
(gateway receipt -> first chunk with tokens), e2e_ms, finish_reason ("error" with the gRPC code
on failure), completion_tokens, drafted_tokens, accepted_tokens, num_drafts. The queue wait
is known to the coordinator only: ``coordinator.request``'s ``minedraft.queue_wait_ms``.

With tracing off the tracer is the no-op one; the cost is a context attach/detach per chunk.

The same wrapper feeds the gateway's Prometheus metrics (default registry, served at the HTTP
API's ``/metrics``): ``minedraft:gateway_time_to_first_token_seconds``,
``minedraft:gateway_e2e_request_latency_seconds`` (client-facing, incl. tokenization and
detokenization) and ``minedraft:gateway_requests_total{finish_reason}``. The engine-side
figures (acceptance, steps, PSD ratios) are the coordinator's ``--metrics-port``.
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import Counter, Histogram

from minedraft.telemetry import tracer
from minedraft.v1 import generate_pb2

_ATTR = "minedraft."
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TTFT_SECONDS = Histogram("minedraft:gateway_time_to_first_token_seconds", "Gateway receipt -> first token chunk (s).",
                         buckets=_LATENCY_BUCKETS_S)
E2E_SECONDS = Histogram("minedraft:gateway_e2e_request_latency_seconds", "Gateway receipt -> end of stream (s).",
                        buckets=_LATENCY_BUCKETS_S)
REQUESTS = Counter("minedraft:gateway_requests", "Finished Generate streams by finish_reason.", ["finish_reason"])


async def traced_generate(request_id: str, num_prompt_tokens: int,
                          stream: AsyncGenerator[generate_pb2.GenerateResponse, None]):
    """Yield ``stream``'s responses inside a ``gateway.generate`` span (see module docstring).

    Each step of ``stream`` runs with the span as the current context, so RPCs it makes are
    children; the context is detached again before each yield (async generators must not leak it).
    Closing this generator closes ``stream``.
    """
    start = time.perf_counter()
    span = tracer().start_span("gateway.generate", attributes={
        f"{_ATTR}request_id": request_id, f"{_ATTR}prompt_tokens": num_prompt_tokens})
    ctx = trace.set_span_in_context(span)
    is_first, finish_reason = True, "cancelled"
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                response = await anext(stream)
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            kind = response.WhichOneof("response")
            if kind == "chunk" and is_first and response.chunk.token_ids:
                is_first = False
                span.set_attribute(f"{_ATTR}ttft_ms", (time.perf_counter() - start) * 1e3)
                TTFT_SECONDS.observe(time.perf_counter() - start)
            elif kind == "complete":
                finish_reason = response.complete.finish_reason
                _set_complete(span, response.complete)
            elif kind == "error":
                finish_reason = "error"
                span.set_attributes({f"{_ATTR}finish_reason": "error", f"{_ATTR}error_code": response.error.code})
                span.set_status(trace.StatusCode.ERROR, response.error.message)
            yield response
    finally:
        token = otel_context.attach(ctx)
        try:
            await stream.aclose()  # closing early must reach the inner stream (it aborts the request)
        finally:
            otel_context.detach(token)
            e2e_s = time.perf_counter() - start
            span.set_attribute(f"{_ATTR}e2e_ms", e2e_s * 1e3)
            span.end()
            E2E_SECONDS.observe(e2e_s)
            REQUESTS.labels(finish_reason=finish_reason).inc()


def _set_complete(span: trace.Span, complete: generate_pb2.GenerateComplete) -> None:
    usage = complete.usage
    span.set_attributes({
        f"{_ATTR}finish_reason": complete.finish_reason, f"{_ATTR}completion_tokens": usage.completion_tokens,
        f"{_ATTR}drafted_tokens": usage.num_draft_tokens, f"{_ATTR}accepted_tokens": usage.num_accepted_tokens,
        f"{_ATTR}num_drafts": usage.num_drafts})
