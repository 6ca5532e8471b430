"""The gateway's request span ``gateway.generate`` (OpenTelemetry; torch-free).

One span per Generate request (gRPC or HTTP front end), the root of the request's trace when
the client sent no ``traceparent``, else a child of the server span. The coordinator
``Generate`` call is made inside it, so the coordinator's spans join the same trace
(``coordinator.tracing``). Attributes (``minedraft.*``): request_id, prompt_tokens, ttft_ms
(gateway receipt -> first chunk with tokens), e2e_ms, finish_reason ("error" with the gRPC code
on failure), completion_tokens, drafted_tokens, accepted_tokens, num_drafts. The queue wait
is known to the coordinator only: ``coordinator.request``'s ``minedraft.queue_wait_ms``.

With tracing off the tracer is the no-op one; the cost is a context attach/detach per chunk.
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from opentelemetry import context as otel_context
from opentelemetry import trace

from minedraft.telemetry import tracer
from minedraft.v1 import generate_pb2

_ATTR = "minedraft."


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
    is_first = True
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
            elif kind == "complete":
                _set_complete(span, response.complete)
            elif kind == "error":
                span.set_attributes({f"{_ATTR}finish_reason": "error", f"{_ATTR}error_code": response.error.code})
                span.set_status(trace.StatusCode.ERROR, response.error.message)
            yield response
    finally:
        token = otel_context.attach(ctx)
        try:
            await stream.aclose()  # closing early must reach the inner stream (it aborts the request)
        finally:
            otel_context.detach(token)
            span.set_attribute(f"{_ATTR}e2e_ms", (time.perf_counter() - start) * 1e3)
            span.end()


def _set_complete(span: trace.Span, complete: generate_pb2.GenerateComplete) -> None:
    usage = complete.usage
    span.set_attributes({
        f"{_ATTR}finish_reason": complete.finish_reason, f"{_ATTR}completion_tokens": usage.completion_tokens,
        f"{_ATTR}drafted_tokens": usage.num_draft_tokens, f"{_ATTR}accepted_tokens": usage.num_accepted_tokens,
        f"{_ATTR}num_drafts": usage.num_drafts})
