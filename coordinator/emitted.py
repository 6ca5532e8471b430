"""Counters of emitted tokens only, also when the gateway cuts a request at a stop string
(issue 25.2; torch-free).

The coordinator cuts a committed block itself at EOS, a stop id or ``max_tokens``
(``coordinator.finish``), but stop strings are matched in the gateway's detokenized text, after
the coordinator has streamed the block (and maybe more). So the blocks of a request with stop
strings (``CoordinatorGenerateRequest.has_stop_strings``) are held, not counted, until the gateway
says how many output tokens the client got: ``AbortRequest.num_output_tokens``, sent when it cut
the request and also, with all of them, when the request finished on its own. Then the blocks are
counted as if the coordinator had finished the request there (:func:`cut_blocks`): a block past
the cut is dropped, the block holding it keeps its first tokens, whose leading ones are its
accepted draft tokens (then the recovered or bonus token).

Counted per block: the Prometheus counters ``generation_tokens``, ``spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``
(``CoordinatorMetrics.observe_block``); the step totals of ``GetStatus`` are recorded per step and
the cut-off part is taken back at settlement (``StepTotals.retract``). Requests without stop
strings are counted at once. A request whose settlement never comes (a gateway that died) is
counted in full once ``MAX_UNSETTLED`` newer ones wait, or when its id is reused.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

MAX_UNSETTLED = 1024


@dataclass(frozen=True)
class Block:
    """One committed block of a request as streamed by the coordinator.

    Attributes:
        num_draft_tokens: k of its verify step (0: the first token, or a step without drafts).
        num_accepted_tokens: accepted draft tokens among the emitted ones (they come first).
        num_tokens: tokens emitted (after the coordinator's own finish truncation).
    """

    num_draft_tokens: int
    num_accepted_tokens: int
    num_tokens: int


def cut_blocks(blocks: list[Block], num_output_tokens: int) -> list[Block]:
    """``blocks`` as if the request had ended after its first ``num_output_tokens`` tokens."""
    kept, start = [], 0
    for block in blocks:
        if start >= num_output_tokens:
            break
        num_tokens = min(block.num_tokens, num_output_tokens - start)
        kept.append(Block(block.num_draft_tokens, min(block.num_accepted_tokens, num_tokens), num_tokens))
        start += block.num_tokens
    return kept


class EmittedCounter:
    """Counts each request's blocks at once, or holds them until the gateway settles it.

    Args:
        metrics: a ``coordinator.metrics.CoordinatorMetrics``.
        totals: the loop's ``coordinator.stats.StepTotals``.
        max_unsettled: finished requests kept waiting for their settlement at most.
    """

    def __init__(self, metrics, totals, max_unsettled: int = MAX_UNSETTLED) -> None:
        self.metrics = metrics
        self.totals = totals
        self.max_unsettled = max_unsettled
        self._unsettled: collections.OrderedDict[str, list[Block]] = collections.OrderedDict()

    def on_block(self, request, block: Block) -> None:
        """A block of ``request`` (a ``RequestState``) was streamed: count or hold it."""
        if request.has_stop_strings:
            request.blocks.append(block)
        else:
            self.metrics.observe_block(block)

    def on_retire(self, request) -> None:
        """``request`` finished in the coordinator: a held one waits for its settlement."""
        if not request.has_stop_strings:
            return
        self.settle(request.request_id)  # an older request of that id that was never settled
        self._unsettled[request.request_id] = request.blocks
        while len(self._unsettled) > self.max_unsettled:
            self.settle(next(iter(self._unsettled)))

    def settle(self, request_id: str, num_output_tokens: int | None = None) -> bool:
        """Count a finished held request's blocks up to ``num_output_tokens`` (None: all);
        False when nothing waits under ``request_id``."""
        blocks = self._unsettled.pop(request_id, None)
        if blocks is None:
            return False
        kept = blocks if num_output_tokens is None else cut_blocks(blocks, max(num_output_tokens, 0))
        for block in kept:
            self.metrics.observe_block(block)
        self.totals.retract(
            num_draft_tokens=sum(b.num_draft_tokens for b in blocks) - sum(b.num_draft_tokens for b in kept),
            num_accepted_tokens=sum(b.num_accepted_tokens for b in blocks) - sum(b.num_accepted_tokens for b in kept),
            num_emitted_tokens=sum(b.num_tokens for b in blocks) - sum(b.num_tokens for b in kept))
        return True

    @property
    def num_unsettled(self) -> int:
        return len(self._unsettled)
