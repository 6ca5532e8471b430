"""gRPC clients of drafter_svc and verifier_svc, and torch-free ``minedraft.v1.Tensor`` helpers.

The coordinator never imports torch: draft token ids travel as int32 ``Tensor`` messages
(little-endian raw bytes, row-major) and draft probabilities are sliced per request row as raw
bytes (inline data plane), never decoded.
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from minedraft.serving import aio_channel
from minedraft.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from coordinator.request import PendingDrafts, RequestState

# errors of the call itself, not of one request: no point in retrying requests one by one
_TRANSPORT_ERRORS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# a drafter's answer about one request (engine_svc.service.grpc_code_of: a CapacityError, a
# bad prompt or id); any other error (INTERNAL, UNIMPLEMENTED, ...) means the drafter itself is broken
_REFUSAL_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
_INT_TYPECODES = {"int32": "i", "int64": "q"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8}


PADDING_TOKEN_ID = -1  # fills ragged draft rows past their k_i on the wire


def encode_token_ids(rows: Sequence[Sequence[int]], is_ragged: bool = False) -> common_pb2.Tensor:
    """[batch, k] token ids -> int32 ``Tensor`` (little-endian). ``is_ragged``: rows shorter
    than the longest are padded with ``PADDING_TOKEN_ID``; else ragged rows raise ValueError."""
    num_cols = max((len(row) for row in rows), default=0)
    if not is_ragged and any(len(row) != num_cols for row in rows):
        raise ValueError("rows: draft token id rows must all have length k")
    values = array("i", [t for row in rows for t in [*row, *[PADDING_TOKEN_ID] * (num_cols - len(row))]])
    if sys.byteorder == "big":
        values.byteswap()
    return common_pb2.Tensor(shape=[len(rows), num_cols], dtype="int32", data=values.tobytes())


def decode_token_ids(tensor: common_pb2.Tensor) -> list[list[int]]:
    """int32/int64 ``Tensor`` of shape [batch, k] -> nested lists. Raises ValueError otherwise."""
    if tensor.dtype not in _INT_TYPECODES or len(tensor.shape) != 2:
        raise ValueError(f"tensor: expected int32/int64 [batch, k], got {tensor.dtype} {list(tensor.shape)}")
    values = array(_INT_TYPECODES[tensor.dtype])
    values.frombytes(tensor.data)
    if sys.byteorder == "big":
        values.byteswap()
    num_rows, num_cols = tensor.shape
    if len(values) != num_rows * num_cols:
        raise ValueError(f"tensor: {len(values)} values do not fill shape {list(tensor.shape)}")
    return [list(values[i * num_cols : (i + 1) * num_cols]) for i in range(num_rows)]


def split_prob_rows(tensor: common_pb2.Tensor, num_rows: int) -> list[bytes]:
    """Split draft probs [batch, k, V] raw bytes into ``num_rows`` per-request [k, V] byte rows."""
    if len(tensor.shape) != 3 or tensor.shape[0] != num_rows or tensor.dtype not in _ITEMSIZE:
        raise ValueError(f"tensor: expected draft probs [{num_rows}, k, V], got {tensor.dtype} {list(tensor.shape)}")
    row_bytes = tensor.shape[1] * tensor.shape[2] * _ITEMSIZE[tensor.dtype]
    if len(tensor.data) != row_bytes * num_rows:
        raise ValueError(f"tensor: {len(tensor.data)} bytes do not fill shape {list(tensor.shape)}")
    return [tensor.data[i * row_bytes : (i + 1) * row_bytes] for i in range(num_rows)]


def join_prob_rows(drafts: Sequence[PendingDrafts]) -> common_pb2.Tensor | None:
    """Stack the per-request prob rows of a verify batch back into [batch, k, V], k = the
    longest row's k_i (each row's [K, V] bytes from its Draft call cut to its first k positions;
    positions past a row's own k_i are the drafter's zero padding); None if absent."""
    if not drafts or any(d.probs_row is None for d in drafts):
        return None
    first = drafts[0]
    num_cols = max(len(d.token_ids) for d in drafts)
    row_bytes = num_cols * first.vocab_size * _ITEMSIZE[first.probs_dtype]
    if any(len(d.probs_row) < row_bytes for d in drafts):
        raise ValueError(f"drafts: probs rows narrower than k = {num_cols}")
    shape = [len(drafts), num_cols, first.vocab_size]
    data = b"".join(d.probs_row[:row_bytes] for d in drafts)
    return common_pb2.Tensor(shape=shape, dtype=first.probs_dtype, data=data)


@dataclass
class DraftResult:
    """Outcome of one Draft call: per-request drafts plus times in ms."""

    drafts: list[PendingDrafts]
    draft_ms: float
    data_plane_ms: float
    wall_ms: float
    service_ms: float = 0.0  # the drafter's own wall time on the call (DraftResponse.service_ms)
    sent_s: float = 0.0  # when the Draft RPC was sent (Unix s)
    service_start_s: float = 0.0  # when the drafter's handler started (DraftResponse.service_start_s)


class EngineClients:
    """Async stubs of the drafter (``minedraft.v1.Drafter``) and verifier (``minedraft.v1.Verifier``).

    Every call carries ``rpc_timeout_s``; failures surface as ``grpc.aio.AioRpcError``.
    """

    def __init__(self, drafter: str, verifier: str, rpc_timeout_s: float) -> None:
        self._channels = (aio_channel(drafter), aio_channel(verifier))
        self.drafter = engine_pb2_grpc.DrafterStub(self._channels[0])
        self.verifier = engine_pb2_grpc.VerifierStub(self._channels[1])
        self.timeout = rpc_timeout_s

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def add_requests(self, stub, seqs: list[engine_pb2.SeqInit]) -> engine_pb2.AddRequestsResponse:
        return await stub.AddRequests(engine_pb2.AddRequestsRequest(seqs=seqs), timeout=self.timeout)

    async def prefill_verifier(self, seqs: list[engine_pb2.SeqInit]) -> dict[str, object]:
        """Verifier AddRequests: request id -> first-token ``SeqOutput``, or the ``AioRpcError`` of
        its failed prefill. A batch refused for a reason other than transport (e.g. one prompt too
        long) is retried one request at a time, so a bad prompt fails alone."""
        try:
            response = await self.add_requests(self.verifier, seqs)
            return {out.request_id: out for out in response.outputs}
        except grpc.aio.AioRpcError as exc:
            if len(seqs) == 1 or exc.code() in _TRANSPORT_ERRORS:
                return {seq.request_id: exc for seq in seqs}
        outcomes = await asyncio.gather(*(self.prefill_verifier([seq]) for seq in seqs))
        return {request_id: out for outcome in outcomes for request_id, out in outcome.items()}

    async def add_to_drafter(self, seqs: list[engine_pb2.SeqInit]) -> dict[str, grpc.aio.AioRpcError]:
        """Drafter AddRequests: request id -> the ``AioRpcError`` of each request it refused. A
        batch refused with RESOURCE_EXHAUSTED or INVALID_ARGUMENT (``_REFUSAL_CODES``; it adds all
        or none) is retried one request at a time, so only a bad request is left out. Raises
        grpc.aio.AioRpcError on any other error, transport or INTERNAL alike (the drafter is lost:
        ``coordinator.fallback``)."""
        try:
            await self.add_requests(self.drafter, seqs)
            return {}
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _REFUSAL_CODES:
                raise
            if len(seqs) == 1:
                return {seqs[0].request_id: exc}
        refused: dict[str, grpc.aio.AioRpcError] = {}
        for seq in seqs:  # one at a time: the drafter runs them in one engine thread anyway
            refused.update(await self.add_to_drafter([seq]))
        return refused

    async def release(self, stub, request_ids: list[str]) -> int:
        response = await stub.ReleaseRequests(engine_pb2.ReleaseRequest(request_ids=request_ids), timeout=self.timeout)
        return response.num_released

    async def draft(self, step_id: int, requests: list[RequestState], ks: list[int], data_plane: int) -> DraftResult:
        """Draft ``ks[i]`` (k_i >= 1) tokens for ``requests[i]``, all in one Draft call (ragged
        rows: ``DraftSeq.num_draft_tokens``); tells the drafter the committed tokens it has not seen.

        Updates each request's ``num_drafter_tokens`` (the drafter caught up on a successful call).
        Raises grpc.aio.AioRpcError, or ValueError on a malformed response.
        """
        # Re-send at least the last committed token: a start position earlier than what the
        # drafter saw is valid (it keeps the common prefix), and catch-up always has a token to feed.
        starts = [min(r.num_drafter_tokens, len(r.prompt_token_ids) + len(r.output_token_ids) - 1) for r in requests]
        seqs = [
            engine_pb2.DraftSeq(request_id=r.request_id, start_position=start, token_ids=r.committed[start:],
                                num_draft_tokens=k_i)
            for r, start, k_i in zip(requests, starts, ks)
        ]
        k = max(ks)
        request = engine_pb2.DraftRequest(step_id=step_id, num_speculative_tokens=k, seqs=seqs, data_plane=data_plane)
        sent_s, start = time.time(), time.perf_counter()
        response = await self.drafter.Draft(request, timeout=self.timeout)
        wall_ms = (time.perf_counter() - start) * 1e3
        token_rows = _draft_rows(response, ks)
        prob_rows: list[bytes | None] = [None] * len(requests)
        if response.has_draft_probs and response.HasField("draft_probs"):
            prob_rows = split_prob_rows(response.draft_probs, len(requests))
        dtype = response.draft_probs.dtype or "float32"
        vocab_size = response.draft_probs.shape[2] if len(response.draft_probs.shape) == 3 else 0
        for r in requests:
            r.num_drafter_tokens = len(r.committed)
        has_probs = response.has_draft_probs
        drafts = [
            PendingDrafts(step_id, row, probs, dtype, vocab_size, has_probs) for row, probs in zip(token_rows, prob_rows)
        ]
        return DraftResult(drafts, response.draft_ms, response.data_plane_ms, wall_ms, response.service_ms, sent_s,
                           response.service_start_s)

    async def verify(
        self, step_id: int, request_ids: list[str], drafts: list[PendingDrafts] | None, data_plane: int,
        num_decode_steps: int = 1, on_partial=None, stream_interval: int = 1, max_decode_steps: list[int] = (),
        stream_interval_ms: int = 0,
    ) -> tuple[engine_pb2.VerifyResponse, float]:
        """Verify ``request_ids`` with ``drafts`` (one per request, all from one drafter step; rows
        may differ in k_i: ``VerifyRequest.num_draft_tokens``), or decode them (``drafts`` None:
        k = 0; ``num_decode_steps`` tokens each in this one call). Returns (response, wall ms).
        ``on_partial``: for a multi-step call, stream it (``VerifyStream``) and call this with
        each partial ``VerifyResponse`` (new tokens of the rows since the last) as it comes; the
        returned response is still the whole call's; ``stream_interval``: decode steps per partial
        message (``VerifyRequest.stream_interval``), or sooner once ``stream_interval_ms`` ms
        passed (0: steps only); ``max_decode_steps``: per request, the most
        of the call's steps it runs (``VerifyRequest.max_decode_steps``; empty: all). Raises
        grpc.aio.AioRpcError, and ValueError when a stream ends without its whole response.
        """
        request = engine_pb2.VerifyRequest(step_id=step_id, request_ids=request_ids)
        if not drafts and num_decode_steps > 1:
            request.num_decode_steps = num_decode_steps
            request.max_decode_steps.extend(max_decode_steps)
        if drafts:
            request.draft_token_ids.CopyFrom(encode_token_ids([d.token_ids for d in drafts], is_ragged=True))
            request.num_draft_tokens.extend(len(d.token_ids) for d in drafts)
            request.draft_step_id = drafts[0].step_id
            request.data_plane = data_plane
            request.has_draft_probs = any(d.has_probs for d in drafts)
            probs = join_prob_rows(drafts)
            if probs is not None:
                request.draft_probs.CopyFrom(probs)
        start = time.perf_counter()
        if on_partial is not None and request.num_decode_steps > 1:
            request.stream_interval = stream_interval
            request.stream_interval_ms = stream_interval_ms
            request.stream_joined = True
            response = await self._verify_streamed(request, on_partial)
        else:
            response = await self.verifier.Verify(request, timeout=self.timeout)
        return response, (time.perf_counter() - start) * 1e3

    async def _verify_streamed(self, request: engine_pb2.VerifyRequest, on_partial) -> engine_pb2.VerifyResponse:
        """``VerifyStream``: partial messages to ``on_partial``; returns the last (whole) one."""
        async for response in self.verifier.VerifyStream(request, timeout=self.timeout):
            if not response.is_partial:
                return response
            on_partial(response)
        raise ValueError("VerifyStream ended without the call's whole response")


def _draft_rows(response: engine_pb2.DraftResponse, ks: list[int]) -> list[list[int]]:
    """Each row's k_i draft ids from a DraftResponse of the ragged call asked with ``ks``.
    Raises ValueError unless the ids are [b, max k_i] and the rows' k_i are the ones asked."""
    token_rows = decode_token_ids(response.draft_token_ids)
    k = max(ks)
    if len(token_rows) != len(ks) or any(len(row) != k for row in token_rows):
        raise ValueError(f"draft_token_ids: expected [{len(ks)}, {k}], got {list(response.draft_token_ids.shape)}")
    if response.num_draft_tokens and list(response.num_draft_tokens) != list(ks):
        raise ValueError(f"num_draft_tokens: expected {ks}, got {list(response.num_draft_tokens)}")
    return [row[:k_i] for row, k_i in zip(token_rows, ks)]
