"""The public gRPC service ``minedraft.v1.MineDraft`` (grpc.aio, torch-free).

Generate: validate + tokenize (``gateway.validation``) -> coordinator ``Generate`` stream ->
one public chunk per engine step with the incremental text (``gateway.output``) -> exactly one
``complete`` or ``error`` (with ``n`` / ``best_of`` > 1: one coordinator request per sample and
one ``complete`` per choice, ``gateway.choices``). Invalid requests end with status
INVALID_ARGUMENT naming the field.
A matched stop string, a client cancel, or a dropped stream aborts the request at the
coordinator so its KV slots are freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.serving import ServingHealth, aio_channel, mirror_health
from minedraft.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, generate_pb2, generate_pb2_grpc

from gateway.choices import coordinator_ids, stream_choices
from gateway.config import GatewayConfig
from gateway.output import RequestOutput
from gateway.tokenizer import PromptTokenizer
from gateway.tracing import traced_generate
from gateway.validation import MAX_REQUEST_ID_CHARS, InvalidRequestError, PreparedRequest, check_wire, prepare_request
from gateway.wire import MalformedRequest

logger = logging.getLogger(__name__)

FINISH_ABORT = "abort"
HEALTH_RETRY_S = 0.5
ABORT_TIMEOUT_S = 5.0
CANCEL_NOTICE_S = 0.5  # how long a re-sent id waits for the gateway to notice its holder's client cancel
_POLL_S = 0.01
SERVICE_NAME = "minedraft.v1.MineDraft"


class _Run:
    """One ``GatewayServicer.run`` holding a request id (the owner token in ``_in_flight``).

    Attributes:
        context: its gRPC call's context (None over HTTP).
        coordinator_ids: its requests at the coordinator (one per sample with n / best_of > 1).
        is_closing: set once it ends (final message sent, or a cancel being cleaned up): the
            id is about to be free, so a re-send of the same id waits for ``released``.
        released: set once it no longer holds the id.
    """

    def __init__(self, coordinator_ids: list[str], context=None) -> None:
        self.context = context
        self.coordinator_ids = coordinator_ids
        self.is_closing = False
        self.released = asyncio.Event()
        self.num_complete = 0

    def is_ending(self) -> bool:
        """True once it is closing, or its client has cancelled the call (the handler may not
        have seen the cancel yet)."""
        return self.is_closing or (self.context is not None and self.context.cancelled())


class GatewayServicer(generate_pb2_grpc.MineDraftServicer):
    """Implements Generate, Abort and ListModels in front of one coordinator."""

    def __init__(self, cfg: GatewayConfig, tokenizer: PromptTokenizer) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        self._channel = aio_channel(cfg.coordinator)
        self._coordinator = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._in_flight: dict[str, _Run] = {}  # request id -> the run() that owns it

    @property
    def coordinator_channel(self) -> grpc.aio.Channel:
        """The channel every coordinator RPC of this servicer uses."""
        return self._channel

    async def close(self) -> None:
        """Closes the coordinator channel."""
        await self._channel.close()

    async def _abort_at_coordinator(self, request_id: str, num_output_tokens: int | None = None) -> bool:
        """Abort ``request_id`` at the coordinator; ``num_output_tokens``: the output tokens the
        client got, so that its counters count only those (issue 25.2; ``coordinator.emitted``)."""
        try:
            response = await self._coordinator.Abort(
                common_pb2.AbortRequest(request_id=request_id, num_output_tokens=num_output_tokens),
                timeout=ABORT_TIMEOUT_S)
            return response.found
        except grpc.aio.AioRpcError as exc:
            logger.warning("abort of %s at the coordinator failed: %s", request_id, exc.details())
            return False

    @property
    def config(self) -> GatewayConfig:
        return self._cfg

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._tokenizer

    def prepare(self, request: generate_pb2.GenerateRequest) -> PreparedRequest:
        """Validates and tokenizes ``request`` (shared by the gRPC and HTTP front ends).
        Call it on the event-loop thread: the tokenizer is not thread-safe (see PromptTokenizer).

        Raises:
            InvalidRequestError: a field is invalid, or the request id is already in flight.
        """
        prepared = prepare_request(request, self._tokenizer, self._cfg)
        for request_id in {prepared.request_id, *coordinator_ids(prepared)}:
            if request_id in self._in_flight:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        return prepared

    async def run(self, prepared: PreparedRequest, context=None):
        """Streams one prepared request: GenerateResponse chunks, then one ``complete`` or ``error``.
        Closing the generator early aborts the request at the coordinator. ``context``: the gRPC
        call's, so a re-send of the id right after a client cancel can wait for the id to be free."""
        owner = _Run(coordinator_ids(prepared), context)
        held = {prepared.request_id, *owner.coordinator_ids}
        self._in_flight.update(dict.fromkeys(held, owner))
        try:
            async with contextlib.aclosing(self._choices(prepared, owner)) as stream:
                async for response in stream:
                    if response.WhichOneof("response") == "error" or self._is_last(response, prepared, owner):
                        owner.is_closing = True
                    yield response
        finally:
            for request_id in held:
                self._release(request_id, owner)

    def _choices(self, prepared: PreparedRequest, owner: _Run):
        """The stream of one request (``n`` / ``best_of`` > 1: of its samples, ``gateway.choices``)."""
        def open_child(child: PreparedRequest):
            return traced_generate(child.request_id, len(child.prompt_token_ids), self._stream(child, owner))

        return open_child(prepared) if prepared.best_of == 1 else stream_choices(prepared, open_child)

    @staticmethod
    def _is_last(response, prepared: PreparedRequest, owner: _Run) -> bool:
        """Whether ``response`` is the request's last ``complete`` (the n-th with n > 1)."""
        if response.WhichOneof("response") != "complete":
            return False
        owner.num_complete += 1
        return owner.num_complete == prepared.n

    async def wait_if_ending(self, request_id: str) -> None:
        """Before a gRPC request takes ``request_id``: if a run holds it, waits up to
        ``CANCEL_NOTICE_S`` for that run to be ending (a client cancel arrives just before the
        re-send, but its handler may be told after the new call starts), then up to
        ``ABORT_TIMEOUT_S`` for it to free the id. A live duplicate is then refused by ``prepare``."""
        owner = self._in_flight.get(request_id)
        if owner is None:
            return
        deadline = asyncio.get_running_loop().time() + CANCEL_NOTICE_S
        while not owner.is_ending() and not owner.released.is_set():
            if asyncio.get_running_loop().time() >= deadline:
                return
            await asyncio.sleep(_POLL_S)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(owner.released.wait(), ABORT_TIMEOUT_S)

    def _owns(self, request_id: str, owner: _Run) -> bool:
        """Whether ``owner``'s run still holds ``request_id`` (an Abort may have freed it already,
        and a new request may hold it now)."""
        return self._in_flight.get(request_id) is owner

    def _release(self, request_id: str, owner: _Run) -> None:
        """Free ``request_id`` for reuse, if ``owner`` still holds it."""
        if self._owns(request_id, owner):
            del self._in_flight[request_id]
        owner.released.set()

    async def Generate(self, request, context):
        await _refuse_malformed(request, context)
        await self.wait_if_ending(request.request_id)
        try:
            prepared = self.prepare(request)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        async with contextlib.aclosing(self.run(prepared, context)) as stream:
            async for response in stream:
                yield response

    async def _stream(self, prepared, owner: _Run):
        request_id = prepared.request_id
        output = RequestOutput(self._tokenizer.hf_tokenizer, prepared.prompt_token_ids,
                               prepared.stops, prepared.include_stop_str_in_output)
        call = self._coordinator.Generate(coordinator_pb2.CoordinatorGenerateRequest(
            request_id=request_id, prompt_token_ids=prepared.prompt_token_ids, sampling=prepared.sampling,
            has_stop_strings=bool(prepared.stops)))
        is_done = False
        try:
            async for response in call:
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    yield generate_pb2.GenerateResponse(request_id=request_id, chunk=output.on_chunk(response.chunk))
                    if output.is_stopped:
                        break
                elif kind == "finished":
                    is_done = True
                    await _read_to_end(call)
                    if prepared.stops and self._owns(request_id, owner):  # settle its counters, held
                        await self._abort_at_coordinator(request_id, len(output.output_token_ids))
                    async for final in self._finish(output, request_id, response.finished.finish_reason,
                                                    response.finished.usage if response.finished.HasField("usage") else None):
                        yield final
                    return
                else:
                    is_done = True
                    await _read_to_end(call)
                    yield generate_pb2.GenerateResponse(request_id=request_id, error=response.error)
                    return
            if output.is_stopped:
                is_done = True
                call.cancel()
                if self._owns(request_id, owner):
                    await self._abort_at_coordinator(request_id, len(output.output_token_ids))
                async for final in self._finish(output, request_id, FINISH_ABORT, None):
                    yield final
                return
            is_done = True
            yield _error(request_id, grpc.StatusCode.INTERNAL, "coordinator stream ended without a finish")
        except grpc.aio.AioRpcError as exc:
            is_done = True
            yield _error(request_id, exc.code(), _coordinator_error(exc, len(output.output_token_ids)))
        finally:
            if not is_done:  # client cancelled or the stream broke: free the slots
                owner.is_closing = True
                call.cancel()
                if self._owns(request_id, owner):  # not already aborted (Abort frees the id)
                    await asyncio.shield(self._abort_at_coordinator(request_id))

    async def _finish(self, output: RequestOutput, request_id: str, finish_reason: str, usage):
        tail = output.on_finish()
        if tail:
            yield generate_pb2.GenerateResponse(
                request_id=request_id, chunk=generate_pb2.GenerateChunk(text=tail))
        yield generate_pb2.GenerateResponse(request_id=request_id, complete=output.complete(finish_reason, usage))

    async def Abort(self, request, context):
        await _refuse_malformed(request, context)
        if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request.request_id)}")
        owner = self._in_flight.get(request.request_id)
        if owner is None:
            return common_pb2.AbortResponse(found=False)
        found = any(await asyncio.gather(*(self._abort_at_coordinator(i) for i in owner.coordinator_ids)))
        if found:  # the coordinator has finished it: its id is free for a new request at once
            for request_id in [i for i, run in self._in_flight.items() if run is owner]:
                self._release(request_id, owner)
        return common_pb2.AbortResponse(found=found)

    async def ListModels(self, request, context):
        await _refuse_malformed(request, context)
        card = generate_pb2.ModelCard(id=self._cfg.model_name, draft=self._cfg.draft_name,
                                      max_model_len=self._cfg.max_model_len)
        return generate_pb2.ListModelsResponse(models=[card])


async def _refuse_malformed(request, context) -> None:
    """INVALID_ARGUMENT for a body that did not parse (``gateway.wire.MalformedRequest``) or that
    holds unknown fields (``gateway.validation.check_wire``)."""
    if isinstance(request, MalformedRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
    try:
        check_wire(request)
    except InvalidRequestError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


async def _read_to_end(call) -> None:
    """Reads the coordinator's ``Generate`` stream past its last message (``finished`` or
    ``error``) to its end. The OpenTelemetry client interceptor ends its span when its response
    iterator ends; a stream left after its last message kept the span open until the iterator was
    collected, so the coordinator's server span reached Jaeger without its parent. An error status
    after the last message changes nothing: the request already ended."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for _ in call:
            pass


def _coordinator_error(exc: grpc.aio.AioRpcError, num_sent: int) -> str:
    """The message for a coordinator call that failed: a broken connection (the coordinator
    restarted or died: gRPC's own "Stream removed" / "Socket closed") says so, and how much of the
    output had been sent, so a client knows it may send the request again."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return (f"coordinator unavailable: the connection broke while the request ran ({exc.details()}) "
                f"after {num_sent} output tokens; the request can be sent again")
    return f"coordinator: {exc.details()}"


def _error(request_id: str, code: grpc.StatusCode, message: str) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(
        request_id=request_id, error=common_pb2.GenerateError(code=code.value[0], message=message))


async def mirror_coordinator_health(coordinator: str, health: ServingHealth,
                                    channel: grpc.aio.Channel | None = None) -> None:
    """Keeps the gateway's health equal to the coordinator's (Watch on its overall status):
    SERVING only while the coordinator is SERVING. With ``channel`` (the one Generate calls use,
    ``GatewayServicer.coordinator_channel``) SERVING also means that channel is connected again
    after a coordinator restart. Runs until cancelled (``minedraft.serving.mirror_health``)."""
    await mirror_health(coordinator, health, HEALTH_RETRY_S, channel)
