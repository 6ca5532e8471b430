"""Property tests of the PSD Batch Manager (MineDraft paper §5.1) with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from coordinator.batch_manager import INITIAL_SKIP_BATCH, BatchManager


def _check_invariants(manager: BatchManager, running: set[str]) -> None:
    batch0, batch1 = manager.batch(0), manager.batch(1)
    assert set(batch0) | set(batch1) == running
    assert not set(batch0) & set(batch1), "a request is in both batches"
    assert len(batch0) + len(batch1) == len(running) == len(manager)
    assert manager.balance == len(batch1) - len(batch0)
    assert manager.skip_batch in (0, 1)
    assert manager.draft_batch() == manager.batch(manager.skip_batch)
    assert manager.verify_batch() == manager.batch(1 - manager.skip_batch)


class BatchManagerMachine(RuleBasedStateMachine):
    """Random admit / recycle / flip sequences against a set-based model of the running requests."""

    @initialize()
    def setup(self) -> None:
        self.manager = BatchManager()
        self.running: set[str] = set()
        self.next_id = 0

    @rule(num_new=st.integers(min_value=1, max_value=5))
    def admit(self, num_new: int) -> None:
        ids = [f"r{self.next_id + i}" for i in range(num_new)]
        self.next_id += num_new
        was_started, skip = self.manager.is_started, self.manager.skip_batch
        old_imbalance = abs(self.manager.balance)
        placed = self.manager.assign(ids)
        self.running.update(ids)
        if was_started:
            assert placed == [skip] * num_new, "after the first step new requests join skip_batch"
        else:
            # each new request goes to the smaller batch (recycles may have unbalanced them)
            assert abs(self.manager.balance) <= max(old_imbalance - num_new, 1)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def recycle(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        assert self.manager.recycle(request_id)
        self.running.discard(request_id)
        assert request_id not in self.manager

    @rule()
    def recycle_unknown(self) -> None:
        assert not self.manager.recycle("never-admitted")

    @precondition(lambda self: self.running)
    @rule()
    def flip(self) -> None:
        skip = self.manager.skip_batch
        self.manager.flip()
        assert self.manager.skip_batch == 1 - skip
        assert self.manager.is_started

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "manager"):
            _check_invariants(self.manager, self.running)
            if not self.running:
                assert self.manager.skip_batch == INITIAL_SKIP_BATCH and not self.manager.is_started


TestBatchManagerMachine = BatchManagerMachine.TestCase
TestBatchManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.integers(min_value=0, max_value=40))
def test_assign_before_first_step_balances(num_requests: int) -> None:
    manager = BatchManager()
    manager.assign([f"r{i}" for i in range(num_requests)])
    size0, size1 = manager.batch_sizes()
    assert size0 + size1 == num_requests
    assert manager.balance == size1 - size0
    assert manager.balance in (0, 1)  # ties go to skip_batch (1), drafted first


def test_new_requests_after_first_step_join_skip_batch() -> None:
    manager = BatchManager()
    manager.assign(["a", "b"])
    manager.flip()
    assert manager.skip_batch == 0
    assert manager.assign(["c", "d", "e"]) == [0, 0, 0]
    assert manager.draft_batch() == ["b", "c", "d", "e"]
    assert manager.verify_batch() == ["a"]
    assert manager.balance == len(manager.batch(1)) - len(manager.batch(0))


def test_recycle_updates_balance_and_resets_when_empty() -> None:
    manager = BatchManager()
    manager.assign(["a", "b", "c"])
    manager.flip()
    before = manager.balance
    index = manager.batch_of("a")
    assert manager.recycle("a")
    assert manager.balance == before - (1 if index == 1 else -1)
    for request_id in ("b", "c"):
        manager.recycle(request_id)
    assert manager.batch_sizes() == (0, 0)
    assert (manager.skip_batch, manager.balance, manager.is_started) == (INITIAL_SKIP_BATCH, 0, False)


def test_duplicate_ids_are_rejected_without_side_effects() -> None:
    manager = BatchManager()
    manager.add("a")
    with pytest.raises(ValueError, match="request_ids"):
        manager.assign(["b", "a"])
    with pytest.raises(ValueError, match="request_ids"):
        manager.assign(["c", "c"])
    assert len(manager) == 1 and manager.balance == 1


def test_bad_batch_index_raises() -> None:
    manager = BatchManager()
    with pytest.raises(ValueError, match="index"):
        manager.is_empty(2)
    assert manager.is_empty(0) and manager.is_empty(1)
