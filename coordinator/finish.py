"""Finish detection for a block of committed tokens (torch-free).

A speculative step commits several tokens at once (accepted draft tokens + one recovered/bonus
token). The request may finish *inside* that block: at an EOS token (unless ``ignore_eos``), at a
stop token id, or when the output budget ``max_tokens`` is reached. Semantics follow vLLM's
``check_stop`` (EOS, then stop ids, then length): the EOS/stop token itself is emitted, nothing
after it; never more than ``max_tokens`` tokens in total; a stop token lying beyond the budget
gives ``"length"`` at exactly ``max_tokens`` tokens. Speculative decoding itself: Leviathan et al.
2023; the block-wise commit is the verify step of the MineDraft paper, section 5.1.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class FinishReason(enum.StrEnum):
    """Why a request finished; the strings are the public ``finish_reason`` values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class FinishParamsLike(Protocol):
    """What :func:`apply_finish` reads from a params object (duck-typed).

    ``minedraft.v1.SamplingParams`` messages, ``specdec.sample.sampling.SamplingParams`` and
    :class:`FinishParams` all qualify.
    """

    max_tokens: int
    stop_token_ids: Iterable[int]
    ignore_eos: bool


@dataclass(frozen=True)
class FinishParams:
    """Torch-free view of the finish-related fields of ``minedraft.v1.SamplingParams``.

    Attributes:
        max_tokens: output token budget (tokens), >= 1.
        stop_token_ids: token ids that finish the request with reason ``"stop"`` (kept in output).
        ignore_eos: when True, EOS tokens do not finish the request.

    Raises:
        ValueError: ``max_tokens`` < 1 or a negative stop token id.
    """

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be >= 0, got {self.stop_token_ids!r}")

    @classmethod
    def from_params(cls, params: FinishParamsLike) -> FinishParams:
        """Copy the finish fields of any params object (e.g. a ``SamplingParams`` message)."""
        return cls(
            max_tokens=int(params.max_tokens),
            stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=bool(params.ignore_eos),
        )


def apply_finish(
    new_token_ids: Sequence[int],
    num_emitted_so_far: int,
    params: FinishParamsLike,
    eos_token_ids: Iterable[int],
) -> tuple[list[int], FinishReason | None]:
    """Cut a committed block at the first finish condition.

    Args:
        new_token_ids: tokens committed by this step for one request, in order (length 1..k+1).
        num_emitted_so_far: output tokens already emitted for the request before this block.
        params: object with ``max_tokens``, ``stop_token_ids``, ``ignore_eos`` (see
            :class:`FinishParamsLike`).
        eos_token_ids: the target model's EOS token ids.

    Returns:
        ``(emitted_ids, finish_reason)``: the prefix of ``new_token_ids`` to emit and
        ``FinishReason.STOP`` / ``FinishReason.LENGTH``, or ``None`` when still running.
        A request whose budget is already spent gets ``([], LENGTH)``.

    Raises:
        ValueError: ``num_emitted_so_far`` is negative.
    """
    if num_emitted_so_far < 0:
        raise ValueError(f"num_emitted_so_far: must be >= 0, got {num_emitted_so_far}")
    budget = int(params.max_tokens) - num_emitted_so_far
    if budget <= 0:
        return [], FinishReason.LENGTH
    stop_ids = frozenset(int(t) for t in params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= frozenset(int(t) for t in eos_token_ids)
    emitted: list[int] = []
    for token_id in new_token_ids:
        emitted.append(int(token_id))
        if token_id in stop_ids:
            return emitted, FinishReason.STOP
        if len(emitted) == budget:
            return emitted, FinishReason.LENGTH
    return emitted, None
