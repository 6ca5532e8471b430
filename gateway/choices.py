"""``n`` > 1 and ``best_of``: one public request as several coordinator requests (torch-free).

Each of the ``best_of`` samples is its own request inside the stack (``sd`` / ``psd`` like any
other; the coordinator's queue, admission and KV slots count each): id ``<request_id>#<i>``, and
with ``sampling.seed`` the seed ``seed + i`` (mod 2^63), so a seeded request is reproducible and
its choices differ. Greedy choices are identical.

- ``best_of == n``: the children's chunks stream as they come, relabelled with the parent's id
  and the choice index; each choice ends with its own ``complete``; the stream ends after the
  n-th.
- ``best_of > n``: every child runs to its end, then the n with the highest cumulative logprob
  (the sum of the target logprobs of its output tokens; ties keep the lower index) are sent,
  best first as indices 0..n-1, each its chunks and its ``complete``.
- One child's ``error`` ends the request with that error; the other children are aborted. Closing
  the stream (client cancel, Abort) aborts every child.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import AsyncIterator, Callable

from minedraft.v1 import common_pb2, generate_pb2

from gateway.validation import PreparedRequest

SEED_MODULUS = 2**63  # sampling.seed is an int64 >= 0
CHILD_SEPARATOR = "#"

OpenChild = Callable[[PreparedRequest], AsyncIterator[generate_pb2.GenerateResponse]]


def coordinator_ids(prepared: PreparedRequest) -> list[str]:
    """The coordinator request ids of ``prepared``: its own id, or one per sample."""
    if prepared.best_of == 1:
        return [prepared.request_id]
    return [f"{prepared.request_id}{CHILD_SEPARATOR}{i}" for i in range(prepared.best_of)]


def child_requests(prepared: PreparedRequest) -> list[PreparedRequest]:
    """One single-sample request per ``best_of`` sample: its own id and, with a seed, seed + i."""
    children = []
    for i, child_id in enumerate(coordinator_ids(prepared)):
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(prepared.sampling)
        if sampling.HasField("seed"):
            sampling.seed = (sampling.seed + i) % SEED_MODULUS
        children.append(dataclasses.replace(prepared, request_id=child_id, sampling=sampling, n=1, best_of=1))
    return children


def _relabel(response: generate_pb2.GenerateResponse, request_id: str, index: int) -> generate_pb2.GenerateResponse:
    out = generate_pb2.GenerateResponse()
    out.CopyFrom(response)
    out.request_id = request_id
    kind = out.WhichOneof("response")
    if kind == "chunk":
        out.chunk.index = index
    elif kind == "complete":
        out.complete.index = index
    return out


def cumulative_logprob(responses: list[generate_pb2.GenerateResponse]) -> float:
    """Sum of the output tokens' target logprobs over one choice's chunks."""
    return sum(sum(r.chunk.logprobs) for r in responses if r.WhichOneof("response") == "chunk")


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Yields ``(i, item)`` from every stream as items come. Closing it cancels the streams still
    running and waits for them (their clean-up aborts their requests at the coordinator)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((i, item))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_choices(prepared: PreparedRequest, open_child: OpenChild) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """The public stream of an ``n`` / ``best_of`` request (see the module docstring);
    ``open_child(child)`` streams one child request."""
    merged = merge([open_child(child) for child in child_requests(prepared)])
    buffered: list[list[generate_pb2.GenerateResponse]] = [[] for _ in range(prepared.best_of)]
    is_buffered = prepared.best_of > prepared.n
    async with contextlib.aclosing(merged):
        async for i, response in merged:
            if response.WhichOneof("response") == "error":
                yield _relabel(response, prepared.request_id, i)
                return
            if is_buffered:
                buffered[i].append(response)
            else:
                yield _relabel(response, prepared.request_id, i)
    if is_buffered:
        ranked = sorted(range(prepared.best_of), key=lambda i: (-cumulative_logprob(buffered[i]), i))
        for index, i in enumerate(ranked[:prepared.n]):
            for response in buffered[i]:
                yield _relabel(response, prepared.request_id, index)
