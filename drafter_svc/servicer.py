"""``minedraft.v1.Drafter`` over ``specdec.engine.worker.DraftWorker`` (grpc.aio).

Every RPC that touches the model runs in the single engine thread (``EngineExecutor``).
Errors: unknown request id -> NOT_FOUND; no slot / draft KV full -> RESOURCE_EXHAUSTED; bad
ids, shapes or params -> INVALID_ARGUMENT; DIST asked of a drafter started without the dist
plane -> FAILED_PRECONDITION; an RPC before the model is loaded -> UNAVAILABLE.

Draft probs (paper §5: the verifier needs q to stay lossless) go out by the configured data
plane: inline in ``DraftResponse.draft_probs``, or kept for the verifier's on-demand fetch
(``specdec.dataplane.dist.DraftProbsServer``). Draft token ids are always inline.
"""

from __future__ import annotations

import time

import grpc
import torch
from opentelemetry import trace

from engine_svc.service import (
    EngineExecutor,
    abort_with,
    check_unique_ids,
    elapsed_ms,
    engine_info,
    to_sampling_params,
)
from minedraft.v1 import engine_pb2, engine_pb2_grpc
from specdec.dataplane.dist import DraftProbsServer
from specdec.sample.sampling import SamplingParams
from engine_svc.tensor_proto import tensor_to_proto

WARMUP_REQUEST_ID = "__minedraft_warmup__"
WARMUP_NUM_TOKENS = 4
WARMUP_K = 2
PADDING_TOKEN_ID = -1  # DraftResponse.draft_token_ids past a row's k_i
_tracer = trace.get_tracer("minedraft.drafter")


class DrafterServicer(engine_pb2_grpc.DrafterServicer):
    """The drafter's RPCs. ``attach`` gives it the worker once the model is loaded.

    Args:
        model_name: reported in ``EngineInfo.model``.
        data_plane: ``DATA_PLANE_INLINE`` or ``DATA_PLANE_DIST`` (default of requests that
            leave ``data_plane`` unspecified).
        probs_server: the dist plane's server; required for ``DATA_PLANE_DIST``.
    """

    def __init__(self, model_name: str, data_plane: int, probs_server: DraftProbsServer | None = None) -> None:
        if data_plane == engine_pb2.DATA_PLANE_DIST and probs_server is None:
            raise ValueError("data_plane DIST needs a probs_server")
        self.model_name = model_name
        self.data_plane = data_plane
        self.probs_server = probs_server
        self.executor = EngineExecutor("drafter-engine")
        self.worker = None
        self._request_ids: set[str] = set()

    def attach(self, worker) -> None:
        """Serve with ``worker`` (a ``specdec.engine.worker.DraftWorker``)."""
        self.worker = worker

    # ---- engine-thread functions (synchronous) ------------------------------------------
    def _add_all(self, seqs: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Add every request or none (batched prefill; ``DraftWorker.add_requests`` refuses repeated ids)."""
        if not seqs:   # nothing to add (vLLM's drafter would fail on an empty batch)
            return
        self.worker.add_requests(seqs)
        self._request_ids.update(rid for rid, _, _ in seqs)

    def _draft(self, request: engine_pb2.DraftRequest, plane: int) -> engine_pb2.DraftResponse:
        """Draft k_i tokens per seq (``DraftSeq.num_draft_tokens``, default k) in one call; the
        response's ids [b, k] are -1 and its probs [b, k, V] zero past each row's k_i, and
        ``num_draft_tokens`` lists the k_i (the dist/ipc planes get them with the probs)."""
        request_ids = [seq.request_id for seq in request.seqs]
        check_unique_ids(request_ids)
        k = request.num_speculative_tokens
        ks = _row_ks(request)
        committed = [(seq.start_position, list(seq.token_ids)) for seq in request.seqs]
        start = time.perf_counter()
        with _tracer.start_as_current_span("drafter.draft", attributes={"minedraft.batch_size": len(request_ids),
                                                                        "minedraft.k": k}):
            token_ids, probs = self.worker.draft(request_ids, committed, ks)
        response = engine_pb2.DraftResponse(step_id=request.step_id, draft_ms=elapsed_ms(start), num_draft_tokens=ks)
        padded = [row + [PADDING_TOKEN_ID] * (k - len(row)) for row in token_ids]
        ids = torch.tensor(padded, dtype=torch.int32).view(len(request_ids), k)
        response.draft_token_ids.CopyFrom(tensor_to_proto(ids))
        if probs is not None:
            probs = torch.nn.functional.pad(probs, (0, 0, 0, k - probs.shape[1])) if probs.shape[1] < k else probs
            start = time.perf_counter()
            with _tracer.start_as_current_span("drafter.data_plane_send",
                                               attributes={"minedraft.bytes": probs.numel() * probs.element_size()}):
                if plane == engine_pb2.DATA_PLANE_DIST:
                    self.probs_server.publish(request.step_id, request_ids, probs, ks)
                else:
                    response.draft_probs.CopyFrom(tensor_to_proto(probs))
            response.has_draft_probs = True
            response.data_plane_ms = elapsed_ms(start)
        return response

    def _release(self, request_ids: list[str]) -> int:
        known = [rid for rid in dict.fromkeys(request_ids) if rid in self._request_ids]
        for request_id in known:
            self.worker.release(request_id)
            self._request_ids.discard(request_id)
        return len(known)

    def warm_up(self) -> None:
        """Add, draft (sampled, so probs are built) and release a dummy request (span ``drafter.warm_up``)."""
        with _tracer.start_as_current_span("drafter.warm_up"):
            self._warm_up()

    def _warm_up(self) -> None:
        """One dummy request per draft process (``DraftProcesses`` homes them one on each)."""
        prompt = list(range(1, 1 + WARMUP_NUM_TOKENS))
        ids = [f"{WARMUP_REQUEST_ID}{i}" for i in range(getattr(self.worker, "num_processes", 1))]
        self._add_all([(rid, prompt, SamplingParams(temperature=1.0, seed=0)) for rid in ids])
        try:
            self.worker.draft(ids, [(0, prompt)] * len(ids), WARMUP_K)
        finally:
            self._release(ids)

    # ---- RPCs -----------------------------------------------------------------------------
    async def _check_ready(self, context) -> None:
        if self.worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter model is still loading")

    async def AddRequests(self, request, context):
        await self._check_ready(context)
        start = time.perf_counter()
        try:
            seqs = [(s.request_id, list(s.prompt_token_ids), to_sampling_params(s.sampling)) for s in request.seqs]
            await self.executor.run(self._add_all, seqs)
        except Exception as exc:
            await abort_with(context, exc)
        return engine_pb2.AddRequestsResponse(forward_ms=elapsed_ms(start))

    async def Draft(self, request, context):
        """``_draft`` in the engine thread; the response's ``service_ms`` is this handler's wall
        time on the call, ``service_start_s`` its start (Unix s)."""
        start_s, start = time.time(), time.perf_counter()
        await self._check_ready(context)
        plane = request.data_plane or self.data_plane
        if plane == engine_pb2.DATA_PLANE_DIST and self.probs_server is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "DATA_PLANE_DIST asked, but the drafter runs with --data-plane inline")
        try:
            response = await self.executor.run(self._draft, request, plane)
        except Exception as exc:
            await abort_with(context, exc)
        response.service_ms, response.service_start_s = elapsed_ms(start), start_s
        return response

    async def ReleaseRequests(self, request, context):
        await self._check_ready(context)
        try:
            num_released = await self.executor.run(self._release, list(request.request_ids))
        except Exception as exc:
            await abort_with(context, exc)
        return engine_pb2.ReleaseResponse(num_released=num_released)

    async def GetInfo(self, request, context):
        await self._check_ready(context)
        return engine_info(self.worker.facts(), self.model_name, set(self._request_ids))


def _row_ks(request: engine_pb2.DraftRequest) -> list[int]:
    """k_i of each seq (``num_draft_tokens``, or k when unset). Raises ValueError outside [0, k],
    or when k exceeds every k_i (DraftRequest.num_speculative_tokens is the largest k_i)."""
    k = request.num_speculative_tokens
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
    ks = [seq.num_draft_tokens if seq.HasField("num_draft_tokens") else k for seq in request.seqs]
    if any(not 0 <= k_i <= k for k_i in ks):
        raise ValueError(f"num_draft_tokens must lie in [0, num_speculative_tokens={k}], got {ks}")
    if ks and max(ks) != k:  # the response is padded to [b, k(, V)]: a k no row drafts is only memory
        raise ValueError(f"num_speculative_tokens must be the largest num_draft_tokens {max(ks)}, got {k}")
    return ks
