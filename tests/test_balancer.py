"""Feedback balancer (``coordinator.balancer``): property tests over random arrivals, aborts and
finishes, driving BatchManager + Balancer exactly as the step loop does (admission with the
effective skip batch's room, placement, migration before the verify, flip), plus examples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.balancer import Balancer, BalancerConfig, BalancerPolicy
from coordinator.batch_manager import BatchManager

K = 3
NUM_QUIET_STEPS = 24


class Sim:
    """The scheduler's use of the Batch Manager, without engines: requests are ids with KV sizes."""

    def __init__(self, m: int, policy: str = "feedback") -> None:
        self.m, self.balancer = m, Balancer(BalancerConfig(policy=policy))
        self.batches, self.kv, self.waiting = BatchManager(), {}, []
        self.drafted: set[str] = set()  # requests holding drafts for their next verify
        self.is_head_held, self.held_head = False, None
        self.num_new, self.prev_ahead = 0, set()

    def cost_of(self, request_id: str) -> float:
        return self.balancer.request_cost(K + 1, self.kv[request_id])

    def arrive(self, kv_sizes: list[int]) -> None:
        for kv in kv_sizes:
            self.num_new += 1
            request_id = f"r{self.num_new}"
            self.kv[request_id] = kv
            self.waiting.append(request_id)

    def abort(self, picks: list[int]) -> None:
        running = sorted(self.batches.batch(0) + self.batches.batch(1))
        for pick in picks:
            if running:
                request_id = running.pop(pick % len(running))
                self.batches.recycle(request_id)
                self.drafted.discard(request_id)

    def admit(self) -> None:
        num_free = 2 * self.m - len(self.batches)
        if self.batches.is_started:
            num_free = min(num_free, self.m - len(self.batches.batch(self.balancer.effective_skip(self.batches))))
        num = max(min(num_free, len(self.waiting)), 0)
        costs = [self.balancer.request_cost(K + 1, self.kv[r]) for r in self.waiting[:num]]
        admitted = self.balancer.num_to_admit(self.batches, costs, self.m, self.cost_of, self.is_head_held) if num else 0
        if self.is_head_held and num:  # a queue head held back for balance joins at the next step
            assert admitted >= 1 and self.waiting[0] == self.held_head
        self.is_head_held = admitted < num
        self.held_head = self.waiting[admitted] if self.is_head_held else None
        new, self.waiting = self.waiting[:admitted], self.waiting[admitted:]
        self.balancer.assign(self.batches, new, self.cost_of, self.m)

    def step(self, finish_picks: list[int]) -> None:
        if not len(self.batches):
            return
        was_started = self.batches.is_started
        if self.batches.is_empty(1 - self.batches.skip_batch):
            self.batches.flip()
        migrant = self.balancer.pick_migration(self.batches, self.m, self.cost_of)
        if migrant is not None:
            self.batches.move(migrant, self.batches.skip_batch)
            self.drafted.discard(migrant)
        verify, ahead = self.batches.verify_batch(), self.batches.draft_batch()
        if was_started and self.prev_ahead & set(verify + ahead):  # the batch drafted last step is still
            assert all(r in self.drafted for r in verify), (verify, self.drafted)  # there: no sd part
        self.prev_ahead = set(ahead)
        self.drafted -= set(verify)
        self.drafted |= set(ahead)
        for request_id in verify:
            self.kv[request_id] += 2
        for pick in finish_picks:
            if verify:
                self.batches.recycle(verify.pop(pick % len(verify)))
        if ahead:
            self.batches.flip()
        else:
            self.batches.mark_started()

    def check(self) -> None:
        batch0, batch1 = set(self.batches.batch(0)), set(self.batches.batch(1))
        assert not batch0 & batch1 and len(batch0) + len(batch1) == len(self.batches)
        assert self.batches.balance == len(batch1) - len(batch0)
        assert len(batch0) <= self.m and len(batch1) <= self.m

    def imbalance(self) -> tuple[float, float, float]:
        """(|cost 0 - cost 1|, total cost, largest request cost)."""
        costs = [self.balancer.batch_cost(self.batches, i, self.cost_of) for i in (0, 1)]
        largest = max((self.cost_of(r) for r in self.batches.batch(0) + self.batches.batch(1)), default=0.0)
        return abs(costs[0] - costs[1]), sum(costs), largest


events = st.lists(st.tuples(st.lists(st.integers(1, 3000), max_size=4),  # arrivals (KV tokens)
                            st.lists(st.integers(0, 63), max_size=2),  # aborts
                            st.lists(st.integers(0, 63), max_size=2)),  # finishes
                  min_size=1, max_size=30)


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 6), steps=events)
def test_feedback_balancer_invariants_under_random_arrivals_and_aborts(m: int, steps) -> None:
    sim = Sim(m)
    for arrivals, aborts, finishes in steps:
        sim.arrive(arrivals)
        sim.abort(aborts)
        sim.admit()
        sim.check()
        sim.step(finishes)
        sim.check()
    for _ in range(NUM_QUIET_STEPS):  # no more events: the balancer must bring the batches level
        sim.admit()
        sim.step([])
        sim.check()
    diff, total, largest = sim.imbalance()
    lighter_is_full = any(len(sim.batches.batch(i)) == m for i in (0, 1))
    assert diff <= max(sim.balancer.cfg.migrate_ratio * total, largest) + 1e-9 or lighter_is_full, (diff, total)


def test_feedback_rebalances_after_aborts_where_the_paper_rule_stays_lopsided() -> None:
    outcomes = {}
    for policy in ("paper", "feedback"):
        sim = Sim(m=4, policy=policy)
        sim.arrive([100] * 8)
        sim.admit()
        sim.step([])
        sim.abort([0, 1, 2])  # r1, r3, r5: all three from one batch
        for _ in range(6):
            sim.admit()
            sim.step([])
            sim.check()
        outcomes[policy] = sorted(len(sim.batches.batch(i)) for i in (0, 1))
    assert outcomes == {"paper": [1, 4], "feedback": [2, 3]}


def test_new_requests_join_the_cheaper_side_and_wait_at_most_one_step() -> None:
    sim = Sim(m=4)
    sim.arrive([3000, 10])
    sim.admit()
    assert sim.batches.batch_of("r1") != sim.batches.batch_of("r2")
    sim.step([])
    heavy = sim.batches.batch_of("r1")
    sim.arrive([10])
    sim.admit()  # the drafted batch now is the heavy one: the newcomer waits
    if sim.balancer.effective_skip(sim.batches) == heavy:
        assert sim.waiting == ["r3"]
        sim.step([])
        sim.admit()
    assert sim.waiting == [] and sim.batches.batch_of("r3") != heavy


@pytest.mark.parametrize("bad", [{"policy": "best"}, {"kv_weight": -1.0}, {"migrate_ratio": 0.0}])
def test_balancer_config_validation_names_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        BalancerConfig(**bad)
    assert BalancerConfig(policy="feedback").policy == BalancerPolicy.FEEDBACK


def test_step_loop_with_feedback_balancer_keeps_outputs_exact_and_migrates() -> None:
    """Fake engines (coordinator_harness): the imbalance is built deterministically, then the
    balancer must move requests, and every output is still the reference.

    The first wave (long, short, long, short, long, short; all queued in this order before the
    loop admits any) is placed before the first step with equal costs, so it alternates: the three
    long requests (60 tokens) share one batch, the three short ones (4 tokens) the other. The short
    ones finish within a few steps and nothing refills their batch, so the step loop verifies three
    requests against an empty drafted batch: imbalance = the whole cost, above ``migrate_ratio``,
    and every one of them is movable: the balancer must migrate. The second wave joins the running
    loop only after that (its timing decides nothing asserted here but exact outputs).

    Admission is gated so the loop cannot start on the first request alone: with the requests
    racing in over gRPC, which long requests shared a batch (and so whether one ever migrated)
    depended on arrival timing."""
    import asyncio

    from coordinator_harness import Harness, _expected, wait_until

    def sampling(is_long: bool) -> dict:
        return {"max_tokens": 60 if is_long else 4, "ignore_eos": True}

    first = [(f"req-{i}", [3 + i % 9, 5 + (i * 3) % 13], sampling(i % 2 == 0)) for i in range(6)]
    second = [(f"req-{i}", [3 + i % 9, 5 + (i * 3) % 13], sampling(i % 2 == 0)) for i in range(6, 10)]

    async def main():
        async with Harness(mode="psd", max_num_seqs=3, num_speculative_tokens=3, balancer="feedback") as h:
            scheduler, gate, layouts = h.scheduler, asyncio.Event(), []
            assert scheduler.max_num_running == 6  # the first wave is admitted at once
            admit = scheduler._admit

            async def gated_admit():
                await gate.wait()
                await admit()
                if not layouts and scheduler.running:
                    layouts.append(sorted(scheduler.batches.batch(i) for i in (0, 1)))

            scheduler._admit = gated_admit

            def num_migrations() -> float:
                return scheduler.metrics.num_migrations._value.get()

            tasks = []
            for rid, prompt, params in first:  # FIFO order fixed: each is queued before the next is sent
                tasks.append(asyncio.create_task(h.generate(rid, prompt, **params)))
                await wait_until(lambda: rid in scheduler.waiting)
            gate.set()
            await wait_until(lambda: num_migrations() >= 1 or all(t.done() for t in tasks))
            assert layouts == [[["req-0", "req-2", "req-4"], ["req-1", "req-3", "req-5"]]], layouts
            assert num_migrations() >= 1, "long requests verified against an empty batch: no migration"
            for rid, prompt, params in second:
                tasks.append(asyncio.create_task(h.generate(rid, prompt, **params)))
            results = await asyncio.gather(*tasks)
            for (rid, prompt, params), (tokens, reason, _) in zip(first + second, results):
                assert reason == "length" and tokens == _expected(prompt, params), rid
            assert h.num_checked_steps > 0

    asyncio.run(main())
