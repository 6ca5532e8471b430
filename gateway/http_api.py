"""OpenAI-compatible HTTP API of the gateway (FastAPI), in the gateway process.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
ending with ``data: [DONE]`` when ``stream`` is true), ``GET /v1/models``, ``GET /health``
(200 only while the gateway is SERVING, else 503), ``GET /metrics`` (Prometheus text).

Every generation goes through the same ``GatewayServicer.prepare`` / ``run`` as the gRPC API:
validation, tokenization, chat template, detokenization and stop strings are shared.
Errors use the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400 naming the
field in ``param``, 401 wrong API key (when the gateway has one), 404 unknown model or route,
429 overloaded (coordinator RESOURCE_EXHAUSTED), 503 not serving, 500 otherwise. A client that
disconnects before its response starts (a non-streaming request, or a stream still waiting for its
first token) has its request aborted at the coordinator at once (logged as 499, nginx's "client
closed request"); an open stream is aborted by Starlette's own disconnect watch.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException

from minedraft.serving import ServingHealth

from gateway.openai_output import CHAT, COMPLETION, OpenAIOutput
from gateway.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, chat_to_generate, completion_to_generate, openai_param)
from gateway.server import GatewayServicer
from gateway.validation import InvalidRequestError

HTTP_REQUESTS = Counter("minedraft_gateway_http_requests", "HTTP requests by route and status",
                        ["route", "status"])
HTTP_LATENCY = Histogram("minedraft_gateway_http_request_duration_seconds",
                         "Seconds from request to the end of the response (whole stream)", ["route"])
HTTP_TTFT = Histogram("minedraft_gateway_http_time_to_first_token_seconds",
                      "Seconds from request to the first chunk with tokens (TTFT)", ["route"])
HTTP_OUTPUT_TOKENS = Counter("minedraft_gateway_http_output_tokens", "Completion tokens sent over HTTP", ["route"])

_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNAUTHENTICATED: 401,
}
_CODE_OF_VALUE = {code.value[0]: code for code in grpc.StatusCode}
CLIENT_CLOSED_STATUS = 499  # nobody reads it; it labels the request metrics
_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   429: "rate_limit_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape ``{"error": {message, type, param, code}}``."""
    default_type = "invalid_request_error" if 400 <= status < 500 else "internal_error"   # e.g. 405, 413
    return {"error": {"message": message, "type": _TYPE_OF_STATUS.get(status, default_type),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error body with HTTP ``status``."""
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _invalid(exc: InvalidRequestError, body) -> JSONResponse:
    """400 (404 for an unknown model) whose message and ``param`` name the field as the HTTP body
    does (``max_tokens``, not the gRPC path ``sampling.max_tokens``)."""
    param = openai_param(exc.field, body)
    reason = str(exc).removeprefix(f"{exc.field}: ")
    if param == "model" and "unknown model" in reason:
        return error_response(404, reason, param, "model_not_found")
    return error_response(400, f"{param}: {reason}", param)


async def unless_disconnected(request: Request, work) -> Response:
    """Awaits ``work`` (a coroutine making the response) but cancels it once the client is gone:
    cancelling closes ``GatewayServicer.run``, which aborts the request at the coordinator, so it
    does not run on to ``max_tokens`` holding KV slots. Returns 499 then (nobody reads it).

    (``Request.is_disconnected`` never turns true behind Starlette's BaseHTTPMiddleware, which
    the auth middleware is, so this waits on ``receive()``: with the body read, the next ASGI
    message is ``http.disconnect``.)"""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return error_response(CLIENT_CLOSED_STATUS, "client closed the request")
    finally:
        for pending in (task, gone):  # no-op when done; this handler itself cancelled: stop both
            pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone  # a streaming response listens on receive() next


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _body_error(error: dict) -> tuple[str, str | None]:
    """(message, OpenAI param) of a pydantic/FastAPI body error: the field path without union
    branch tags (``prompt.function-after[...]``) nor pydantic's "Value error, " prefix, and no param
    for JSON that does not parse."""
    if error.get("type") == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return f"body: invalid JSON{': ' + detail if detail else ''}", None
    path = _field_path(error.get("loc", ()))
    message = error.get("msg", "invalid").removeprefix("Value error, ")  # pydantic's prefix for a ValueError
    return f"{path or 'body'}: {message}", path or None


def _field_path(loc) -> str:
    """A pydantic error location as the body's field path, in the style the gateway's own checks
    use: ``("body", "messages", 0, "content")`` -> ``messages[0].content`` (union branch tags
    such as ``function-after[...]`` dropped)."""
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif str(part).isidentifier() and not (i == 0 and part == "body"):
            path += f".{part}" if path else str(part)
    return path


def _reported_error(errors: list[dict]) -> dict:
    """The body error to report: the first one, except that for a field a union type validates
    (``prompt``) the first value error of this field's branches (``expected a number, got true``)
    says more than the first branch's type mismatch (``Input should be a valid string``)."""
    field = errors[0].get("loc", ())[:2]
    return next((e for e in errors if e.get("type") == "value_error" and e.get("loc", ())[:2] == field), errors[0])


def _stream_error(error) -> tuple[int, str]:
    code = _CODE_OF_VALUE.get(error.code, grpc.StatusCode.INTERNAL)
    return _STATUS_OF_CODE.get(code, 500), error.message


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class OpenAIFrontend:
    """The HTTP routes over one ``GatewayServicer`` (see the module docstring)."""

    def __init__(self, servicer: GatewayServicer, health: ServingHealth, api_key: str = "") -> None:
        self._servicer = servicer
        self._health = health
        self._api_key = api_key
        self._hf_tokenizer = servicer.tokenizer.hf_tokenizer

    def _decode(self, token_id: int) -> str:
        return self._hf_tokenizer.decode([token_id])

    def is_authorized(self, request: Request) -> bool:
        """True when the gateway has no API key or the request carries it as a Bearer token."""
        given = request.headers.get("authorization", "").encode()
        return not self._api_key or hmac.compare_digest(given, f"Bearer {self._api_key}".encode())

    async def generate(self, route: str, body, kind: str, is_logprobs: bool, include_usage: bool):
        """Runs one generation; JSON or an SSE stream."""
        request_id = uuid.uuid4().hex
        start = time.perf_counter()
        try:
            to_request = chat_to_generate if kind == CHAT else completion_to_generate
            prepared = self._servicer.prepare(to_request(body, request_id))
        except InvalidRequestError as exc:
            return _invalid(exc, body)
        output = OpenAIOutput(kind, request_id, self._servicer.config.model_name, self._decode, is_logprobs)
        stream = self._servicer.run(prepared)
        first = await anext(stream)
        if first.WhichOneof("response") == "error":
            await stream.aclose()
            status, message = _stream_error(first.error)
            return error_response(status, message)
        timing = _Timing(route, start, prepared.n)
        if body.stream:
            return StreamingResponse(self._events(first, stream, output, include_usage, timing),
                                     media_type="text/event-stream")
        return await self._collect(first, stream, output, timing)

    async def _collect(self, first, stream, output: OpenAIOutput, timing: "_Timing") -> JSONResponse:
        async with contextlib.aclosing(stream):
            response, completes = first, []
            while True:
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    timing.on_chunk(response.chunk)
                    output.add_chunk(response.chunk)
                elif kind == "complete":
                    completes.append(response.complete)
                    if timing.on_complete(response.complete):
                        return JSONResponse(output.response_json(completes))
                else:
                    return error_response(*_stream_error(response.error))
                response = await anext(stream)

    async def _events(self, first, stream, output: OpenAIOutput, include_usage: bool, timing: "_Timing"):
        async with contextlib.aclosing(stream):
            response, completes = first, []
            while True:
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    timing.on_chunk(response.chunk)
                    event = output.chunk_json(response.chunk)
                    if event is not None:
                        yield _sse(event)
                elif kind == "complete":
                    completes.append(response.complete)
                    yield _sse(output.finish_chunk_json(response.complete))
                    if timing.on_complete(response.complete):
                        if include_usage:
                            yield _sse(output.usage_chunk_json(completes))
                        break
                else:
                    status, message = _stream_error(response.error)
                    yield _sse(error_body(status, message, None, str(status)))
                    break
                response = await anext(stream)
            yield "data: [DONE]\n\n"

    def models_json(self) -> dict:
        cfg = self._servicer.config
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": 0, "owned_by": "minedraft",
            "root": cfg.model_name, "max_model_len": cfg.max_model_len, "draft": cfg.draft_name or None}]}

    def is_serving(self) -> bool:
        return self._health.is_serving


class _Timing:
    """TTFT and end-to-end latency of one HTTP generation (of its ``n`` choices), into the
    Prometheus histograms."""

    def __init__(self, route: str, start: float, num_choices: int = 1) -> None:
        self.route, self.start, self.is_first = route, start, True
        self.num_left, self.num_tokens = num_choices, 0

    def on_complete(self, complete) -> bool:
        """Counts one choice's end; True (and the histograms updated) at the last one."""
        self.num_left -= 1
        self.num_tokens += len(complete.output_token_ids)
        if self.num_left == 0:
            self.on_done(self.num_tokens)
        return self.num_left == 0

    def on_chunk(self, chunk) -> None:
        if self.is_first and chunk.token_ids:
            HTTP_TTFT.labels(self.route).observe(time.perf_counter() - self.start)
            self.is_first = False

    def on_done(self, num_tokens: int) -> None:
        HTTP_LATENCY.labels(self.route).observe(time.perf_counter() - self.start)
        HTTP_OUTPUT_TOKENS.labels(self.route).inc(num_tokens)


def build_app(frontend: OpenAIFrontend) -> FastAPI:
    """The FastAPI app serving ``frontend`` (see the module docstring for the routes)."""
    app = FastAPI(title="MineDraft", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def count_and_authorize(request: Request, call_next):
        route = request.url.path
        if route.startswith("/v1/") and not frontend.is_authorized(request):
            response = error_response(401, "invalid API key", None, "invalid_api_key")
        else:
            response = await call_next(request)
        HTTP_REQUESTS.labels(route if route in _ROUTES else "other", str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError):
        return error_response(400, *_body_error(_reported_error(exc.errors())))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await unless_disconnected(request, frontend.generate(
            "/v1/chat/completions", body, CHAT, body.logprobs, include_usage))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await unless_disconnected(request, frontend.generate(
            "/v1/completions", body, COMPLETION, body.logprobs is not None, include_usage))

    @app.get("/v1/models")
    async def models():
        return frontend.models_json()

    @app.get("/health")
    async def health():
        return Response(status_code=200 if frontend.is_serving() else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
