"""The Batch Manager of batch-parallel speculative decoding (PSD).

Source: MineDraft paper (Tang, Verma et al. 2026), section 5.1, "Batch Manager".
Running requests are split into two batches, 0 and 1. At every PSD step the drafter drafts
``skip_batch`` (the batch whose verification is *skipped* this step) while the verifier verifies
the other batch with the draft tokens made for it at the previous step; after the step the roles
swap (:meth:`BatchManager.flip`).

Paper state and names:

- ``skip_batch``: index of the batch that only drafts this step; starts at 1.
- ``balance = |batch 1| - |batch 0|``; starts at 0.
- ``assign()``: before the first PSD step new requests are spread over both batches so that
  ``|balance| <= 1``; after it they join the current ``skip_batch``, so each new request is drafted
  before its first verification.
- ``recycle()``: a finished, preempted or aborted request leaves its batch; ``balance`` follows.

Torch-free: it deals in request ids only.
"""

from __future__ import annotations

from collections.abc import Iterable

NUM_BATCHES = 2
INITIAL_SKIP_BATCH = 1


class BatchManager:
    """Two ordered batches of request ids plus the paper's ``skip_batch`` and ``balance``.

    Invariants (checked by property tests): every managed request is in exactly one batch and
    ``balance == |batch 1| - |batch 0|``. When both batches become empty the manager returns to
    its initial state (``skip_batch = 1``, first step not yet run), so the next burst of requests
    is balanced again by :meth:`assign`.
    """

    def __init__(self) -> None:
        # dicts used as insertion-ordered sets: deterministic batch order, O(1) removal.
        self._batches: tuple[dict[str, None], dict[str, None]] = ({}, {})
        self._batch_of: dict[str, int] = {}
        self.skip_batch: int = INITIAL_SKIP_BATCH
        self.balance: int = 0
        self.is_started: bool = False

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._batch_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._batch_of

    def batch(self, index: int) -> list[str]:
        """Request ids of batch ``index`` (0 or 1) in admission order.

        Raises:
            ValueError: ``index`` is not 0 or 1.
        """
        return list(self._batches[_check_index(index)])

    def batch_of(self, request_id: str) -> int:
        """Index of the batch holding ``request_id``; raises KeyError if it is not managed."""
        return self._batch_of[request_id]

    def draft_batch(self) -> list[str]:
        """Request ids drafted (and not verified) this step: the ``skip_batch``."""
        return self.batch(self.skip_batch)

    def verify_batch(self) -> list[str]:
        """Request ids verified this step: the batch other than ``skip_batch``."""
        return self.batch(1 - self.skip_batch)

    def is_empty(self, index: int) -> bool:
        """True when batch ``index`` holds no request."""
        return not self._batches[_check_index(index)]

    def batch_sizes(self) -> tuple[int, int]:
        """``(|batch 0|, |batch 1|)``."""
        return len(self._batches[0]), len(self._batches[1])

    # ------------------------------------------------------------------ updates
    def assign(self, request_ids: Iterable[str]) -> list[int]:
        """Place new requests into batches (paper §5.1 ``assign()``); returns their batch indices.

        Before the first step each request goes to the smaller batch (ties go to ``skip_batch``,
        which is drafted first), keeping ``|balance| <= 1``. After the first step every new request
        joins the current ``skip_batch``.

        Raises:
            ValueError: a request id is already managed (the whole call is rejected).
        """
        request_ids = list(request_ids)
        duplicates = [r for r in request_ids if r in self._batch_of]
        if duplicates or len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids: already managed or repeated: {duplicates or request_ids}")
        return [self._place(r, self._target_batch()) for r in request_ids]

    def place(self, request_id: str, index: int) -> int:
        """Put one new request into batch ``index`` (a balancer's choice, ``coordinator.balancer``).

        Raises:
            ValueError: the request is already managed, or ``index`` is not 0 or 1.
        """
        if request_id in self._batch_of:
            raise ValueError(f"request_id: already managed: {request_id!r}")
        return self._place(request_id, _check_index(index))

    def move(self, request_id: str, index: int) -> None:
        """Move a managed request to batch ``index`` (no-op if it is there already).

        Raises:
            KeyError: the request is not managed. ValueError: ``index`` is not 0 or 1.
        """
        current = self._batch_of[request_id]
        if current != _check_index(index):
            del self._batches[current][request_id]
            self.balance -= 1 if current == 1 else -1
            self._place(request_id, index)

    def add(self, request_id: str) -> int:
        """Assign one new request; see :meth:`assign`. Returns its batch index."""
        return self.assign([request_id])[0]

    def recycle(self, request_id: str) -> bool:
        """Remove a finished, preempted or aborted request; returns False if it was not managed."""
        index = self._batch_of.pop(request_id, None)
        if index is None:
            return False
        del self._batches[index][request_id]
        self.balance -= 1 if index == 1 else -1
        if not self._batch_of:
            self.skip_batch = INITIAL_SKIP_BATCH
            self.is_started = False
        return True

    def flip(self) -> None:
        """Swap the roles of the two batches after a step; marks the first step as done."""
        self.skip_batch = 1 - self.skip_batch
        self.is_started = True

    def mark_started(self) -> None:
        """Record that a step ran without flipping (e.g. an SD fallback step on one batch)."""
        self.is_started = True

    def mark_not_started(self) -> None:
        """Record a step that ran outside PSD (``--mode auto`` chose ``ar``/``sd``, verifying every
        request in one batch): new requests are spread over both batches again, as before the
        first PSD step, so neither batch fills up while the roles do not swap."""
        self.is_started = False

    # ------------------------------------------------------------------ helpers
    def _target_batch(self) -> int:
        if self.is_started:
            return self.skip_batch
        if self.balance == 0:
            return self.skip_batch
        return 0 if self.balance > 0 else 1

    def _place(self, request_id: str, index: int) -> int:
        self._batches[index][request_id] = None
        self._batch_of[request_id] = index
        self.balance += 1 if index == 1 else -1
        return index


def _check_index(index: int) -> int:
    if index not in (0, 1):
        raise ValueError(f"index: batch index must be 0 or 1, got {index!r}")
    return index
