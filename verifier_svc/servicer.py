"""``minedraft.v1.Verifier`` over ``verifier_svc.engine.VerifierEngine`` (grpc.aio, rank 0).

Every RPC that touches the model runs in the single engine thread (``EngineExecutor``); with
TP > 1 that thread also broadcasts the commands to the other ranks. Errors: unknown request id
-> NOT_FOUND (also: dist plane holds no probs for the step), no slot / KV full ->
RESOURCE_EXHAUSTED, bad ids/shapes/params -> INVALID_ARGUMENT, DIST asked of a verifier started
without the dist plane -> FAILED_PRECONDITION, dist plane not connected -> UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import torch
from opentelemetry import trace

from engine_svc.service import EngineExecutor, abort_with, elapsed_ms, engine_info
from minedraft.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from engine_svc.tensor_proto import tensor_to_proto

WARMUP_REQUEST_ID = "__minedraft_warmup__"
WARMUP_NUM_TOKENS = 4
WARMUP_K = 2
_tracer = trace.get_tracer("minedraft.verifier")


class VerifierServicer(engine_pb2_grpc.VerifierServicer):
    """The verifier's RPCs. ``attach`` gives it the engine once the model is loaded.

    Args:
        model_name: reported in ``EngineInfo.model``.
        data_plane: default plane of requests that leave ``data_plane`` unspecified.
        tensor_parallel_size: reported in ``EngineInfo``.
    """

    def __init__(self, model_name: str, data_plane: int, tensor_parallel_size: int = 1) -> None:
        self.model_name = model_name
        self.data_plane = data_plane
        self.tensor_parallel_size = tensor_parallel_size
        self.executor = EngineExecutor("verifier-engine")
        self.engine = None

    def attach(self, engine) -> None:
        """Serve with ``engine`` (a ``VerifierEngine``)."""
        self.engine = engine

    def warm_up(self) -> None:
        """Add a dummy request, verify k sampled drafts with uniform probs (k = 2, or the engine's
        largest k when smaller; 0: one decode step), release it (span ``verifier.warm_up``)."""
        with _tracer.start_as_current_span("verifier.warm_up"):
            self._warm_up()

    def _warm_up(self) -> None:
        vocab = self.engine.vocab_size
        sampling = common_pb2.SamplingParams(temperature=1.0, seed=0, max_tokens=WARMUP_K + 2)
        prompt = list(range(1, 1 + WARMUP_NUM_TOKENS))
        self.engine.add(engine_pb2.AddRequestsRequest(
            seqs=[engine_pb2.SeqInit(request_id=WARMUP_REQUEST_ID, prompt_token_ids=prompt, sampling=sampling)]))
        k = min(WARMUP_K, getattr(self.engine.worker, "max_num_draft_tokens", WARMUP_K))
        try:
            request = engine_pb2.VerifyRequest(request_ids=[WARMUP_REQUEST_ID], data_plane=engine_pb2.DATA_PLANE_INLINE)
            if k > 0:
                request.draft_token_ids.CopyFrom(tensor_to_proto(torch.tensor([prompt[:k]], dtype=torch.int32)))
                request.draft_probs.CopyFrom(tensor_to_proto(torch.full((1, k, vocab), 1.0 / vocab)))
                request.has_draft_probs = True
            self.engine.verify(request, engine_pb2.DATA_PLANE_INLINE)
        finally:
            self.engine.release(engine_pb2.ReleaseRequest(request_ids=[WARMUP_REQUEST_ID]))

    async def _check_ready(self, context) -> None:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier model is still loading")

    async def _plane_of(self, request, context) -> int:
        """The data plane of a Verify call (FAILED_PRECONDITION: dist asked of an inline verifier)."""
        plane = request.data_plane or self.data_plane
        if (request.has_draft_probs and plane == engine_pb2.DATA_PLANE_DIST
                and self.engine.probs_client is None):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "DATA_PLANE_DIST asked, but the verifier runs with --data-plane inline")
        return plane

    async def AddRequests(self, request, context):
        """Prefill in the engine thread; while a multi-step decode call runs there (vLLM engine),
        inside that call, between two of its steps (``VerifierEngine.join_call``)."""
        await self._check_ready(context)
        try:
            request, joined = self.engine.join_call(request)
            if joined is not None:
                return await asyncio.wrap_future(joined)
            return await self.executor.run(self.engine.add_checked, request)
        except Exception as exc:
            await abort_with(context, exc)

    async def Verify(self, request, context):
        """``VerifierEngine.verify`` in the engine thread; the response's ``service_ms`` is this
        handler's wall time on the call, ``service_start_s`` its start (Unix s)."""
        start_s, start = time.time(), time.perf_counter()
        await self._check_ready(context)
        plane = await self._plane_of(request, context)
        try:
            response = await self.executor.run(self.engine.verify, request, plane)
        except Exception as exc:
            await abort_with(context, exc)
        response.service_ms, response.service_start_s = elapsed_ms(start), start_s
        return response

    async def VerifyStream(self, request, context):
        """``Verify``, streaming a multi-step call's tokens as they decode: the engine thread
        hands on its outputs every ``request.stream_interval`` steps (``verifier_svc.streaming``),
        what it handed on since the last message goes out as one partial message (rows merged),
        and the call's whole ``VerifyResponse`` comes last (with the steps no partial carried, and
        ``service_ms``: this handler's wall time up to it, ``service_start_s``: its start). Errors
        as ``Verify``'s."""
        start_s, start = time.time(), time.perf_counter()
        await self._check_ready(context)
        plane = await self._plane_of(request, context)
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue = asyncio.Queue()

        def on_step(outputs: list) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(steps.put_nowait, outputs)
            except RuntimeError:  # the loop closed (shutdown): the call itself goes on
                pass

        on_step_hook = on_step if request.num_decode_steps > 1 else None
        call = asyncio.ensure_future(self.executor.run(self.engine.verify, request, plane, on_step_hook))
        try:
            while not call.done() or not steps.empty():
                ready = await _next_steps(steps, call)
                if ready:
                    yield merge_partial(request.step_id, ready)
            response = call.result()
        except Exception as exc:
            await abort_with(context, exc)
        response.service_ms, response.service_start_s = elapsed_ms(start), start_s
        yield response

    async def ReleaseRequests(self, request, context):
        await self._check_ready(context)
        try:
            num_released = await self.executor.run(self.engine.release, request)
        except Exception as exc:
            await abort_with(context, exc)
        return engine_pb2.ReleaseResponse(num_released=num_released)

    async def GetInfo(self, request, context):
        await self._check_ready(context)
        return engine_info(self.engine.worker.facts(), self.model_name, set(self.engine.request_ids),
                           self.tensor_parallel_size)


async def _next_steps(steps: asyncio.Queue, call: asyncio.Future) -> list[list]:
    """Every step output queued now; when none is, wait for the next one or the call's end
    (then: what the call queued before it ended, possibly nothing)."""
    if steps.empty():
        getter = asyncio.ensure_future(steps.get())
        await asyncio.wait({call, getter}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            return _drain(steps)
        return [getter.result()] + _drain(steps)
    return _drain(steps)


def _drain(steps: asyncio.Queue) -> list[list]:
    ready = []
    while not steps.empty():
        ready.append(steps.get_nowait())
    return ready


def merge_partial(step_id: int, steps: list[list]) -> engine_pb2.VerifyResponse:
    """One partial ``VerifyResponse`` of consecutive decode steps' ``SeqOutput`` lists: per
    request, its tokens (and logprobs, top logprobs) of those steps in order."""
    merged: dict[str, engine_pb2.SeqOutput] = {}
    for outputs in steps:
        for out in outputs:
            row = merged.setdefault(out.request_id, engine_pb2.SeqOutput(request_id=out.request_id))
            row.token_ids.extend(out.token_ids)
            row.logprobs.extend(out.logprobs)
            row.top_logprobs.extend(out.top_logprobs)
    return engine_pb2.VerifyResponse(step_id=step_id, outputs=list(merged.values()), is_partial=True)
