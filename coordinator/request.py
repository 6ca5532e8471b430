"""Per-request state of the coordinator (torch-free).

Terms (docs/ARCHITECTURE.md): the committed sequence of a request is its prompt token ids plus
the output token ids committed so far. The verifier's KV holds it except the last ("pending")
token. The drafter is told, per Draft call, the committed tokens from ``num_drafter_tokens`` on
(``DraftSeq.start_position`` / ``token_ids``), so this record tracks what the drafter has seen.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from minedraft.v1 import common_pb2, coordinator_pb2

from coordinator.finish import FinishParams, FinishReason


class RequestStatus(enum.Enum):
    """Lifecycle of a request in the coordinator."""

    WAITING = "waiting"  # in the FIFO queue, holds no engine slot
    RUNNING = "running"  # holds a slot in the verifier (and the drafter when it drafts)
    FINISHED = "finished"  # stop / length / abort / error: nothing more is streamed


@dataclass
class PendingDrafts:
    """Draft tokens made for one request at a drafter step, waiting for their verify step.

    Attributes:
        step_id: the coordinator step id of the Draft call (``VerifyRequest.draft_step_id``).
        token_ids: the k draft token ids d_1..d_k.
        probs_row: this request's draft probabilities, raw little-endian bytes of shape [k, V]
            (inline data plane and sampled batches only), else None.
        probs_dtype: dtype name of ``probs_row`` ("float32", "bfloat16", "float16").
        vocab_size: V of ``probs_row``.
        has_probs: the drafter sampled (not greedy) and produced probs, inline or on the dist plane.
    """

    step_id: int
    token_ids: list[int]
    probs_row: bytes | None = None
    probs_dtype: str = "float32"
    vocab_size: int = 0
    has_probs: bool = False


@dataclass(eq=False)
class RequestState:
    """One generation request from admission to finish.

    ``outbox`` receives ``CoordinatorGenerateResponse`` messages for the Generate stream; the
    last one is a ``finished`` or an ``error``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    finish_params: FinishParams
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_drafter_tokens: int = 0  # committed tokens the drafter has been told (0 = not added)
    drafts: PendingDrafts | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    trace: object | None = None  # a coordinator.tracing.RequestTrace (span + latency metrics)
    has_stop_strings: bool = False  # the gateway may cut it: counters wait (coordinator.emitted)
    blocks: list = field(default_factory=list)  # its coordinator.emitted.Blocks while held

    @property
    def committed(self) -> list[int]:
        """Prompt + committed output token ids."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_greedy(self) -> bool:
        return self.sampling.temperature == 0.0

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=len(self.output_token_ids),
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_drafts=self.num_drafts,
        )

    def send_chunk(self, token_ids: list[int], logprobs: list[float], num_drafted: int, num_accepted: int,
                   top_logprobs: list = ()) -> None:
        """Stream committed tokens (one step's worth) to the client; ``top_logprobs`` holds one
        ``common_pb2.TopLogprobs`` per token when the request asked for them."""
        chunk = coordinator_pb2.TokenChunk(
            token_ids=token_ids, logprobs=logprobs, num_draft_tokens=num_drafted, num_accepted_tokens=num_accepted,
            top_logprobs=top_logprobs,
        )
        self.outbox.put_nowait(coordinator_pb2.CoordinatorGenerateResponse(chunk=chunk))
        if self.trace is not None:
            self.trace.on_tokens(len(token_ids))

    def finish(self, reason: FinishReason) -> None:
        """Mark finished and send ``Finished`` (no-op if already finished)."""
        if self.status == RequestStatus.FINISHED:
            return
        self.status = RequestStatus.FINISHED
        self.drafts = None
        finished = coordinator_pb2.Finished(finish_reason=str(reason), usage=self.usage())
        self.outbox.put_nowait(coordinator_pb2.CoordinatorGenerateResponse(finished=finished))
        if self.trace is not None:
            self.trace.end(str(reason), finished.usage)

    def fail(self, code: int, message: str) -> None:
        """Mark finished and send ``GenerateError`` (no-op if already finished)."""
        if self.status == RequestStatus.FINISHED:
            return
        self.status = RequestStatus.FINISHED
        self.drafts = None
        error = common_pb2.GenerateError(code=code, message=message)
        self.outbox.put_nowait(coordinator_pb2.CoordinatorGenerateResponse(error=error))
        if self.trace is not None:
            self.trace.end("error", self.usage())
