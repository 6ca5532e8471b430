"""Ragged per-request k in the coordinator (``coordinator.adaptive.KChooser.draft_ks``,
``coordinator.stepping._group_by_draft_step``): a request whose drafts keep being rejected gets a smaller k_i than a well-accepted one in the same Draft call, and the drafted
requests of one drafter step are verified in ONE Verify call whatever their k_i (fake engines of
``coordinator_harness`` over real gRPC; the fake verifier checks every row's drafts)."""

from __future__ import annotations

import asyncio
import collections

import pytest
from test_adaptive import _stats
from test_coordinator import Harness, _expected, _workload

from coordinator.adaptive import NO_DRAFT, AdaptiveConfig, KChooser, KPolicy, SpeculationStats


def test_always_rejected_request_gets_a_smaller_k_than_a_well_accepted_one() -> None:
    """Flat verify (8 ms), 1 ms per draft token: the batch k is 8; "good" (3 of 4 accepted)
    keeps it, "bad" (nothing ever accepted, yet above the undrafted threshold of 0) drafts 1."""
    stats = _stats(draft_ms_per_token=1.0, verify_ms=8.0, alpha_accepts=3, k=4)
    stats.cfg = AdaptiveConfig(min_request_alpha=0.0)
    for _ in range(30):
        stats.observe_verified("good", 4, 3)
        stats.observe_verified("bad", 4, 0)
    chooser = KChooser(KPolicy.ADAPTIVE, 8, stats)
    ks = chooser.draft_ks(["good", "bad", "r0", "r1"], is_parallel=True)
    assert ks["bad"] == 1 < ks["good"] == chooser.batch_k(4, is_parallel=True)
    assert ks == chooser.draft_ks(["good", "bad", "r0", "r1"], is_parallel=True)  # deterministic
    assert KChooser(KPolicy.FIXED, 8, stats).draft_ks(["good", "bad"], is_parallel=True) == {"good": 8, "bad": 8}


def test_unmeasured_costs_give_every_request_the_batch_k() -> None:
    stats = SpeculationStats(AdaptiveConfig(min_request_alpha=0.0))
    for _ in range(20):
        stats.observe_verified("bad", 4, 0)
    assert KChooser(KPolicy.ADAPTIVE, 4, stats).draft_ks(["bad", "x"], is_parallel=False) == {"bad": 4, "x": 4}


class RaggedK(KChooser):
    """The production chooser, with each request's k_i forced to differ: k_i = 1 + (i + call) % k
    over the requests of a Draft call (one request in five left undrafted, k = 0)."""

    def __init__(self, stats, max_k: int) -> None:
        super().__init__("adaptive", max_k, stats)
        self.num_calls = 0

    def draft_ks(self, request_ids: list[str], is_parallel: bool) -> dict[str, int]:
        self.num_calls += 1
        return {rid: NO_DRAFT if (i + self.num_calls) % 5 == 4 else 1 + (i + self.num_calls) % self.max_k
                for i, rid in enumerate(request_ids)}


@pytest.mark.parametrize("mode, data_plane", [("sd", "inline"), ("psd", "inline"), ("psd", "dist")])
def test_one_verify_call_per_drafter_step_with_ragged_k(mode: str, data_plane: str) -> None:
    work = _workload(10)

    async def main():
        harness, calls = Harness(mode=mode, max_num_seqs=4, num_speculative_tokens=4, data_plane=data_plane), []
        verify = harness.verifier.Verify

        async def recording_verify(request, context):  # (before serving: the server binds the method)
            if request.draft_token_ids.shape:
                calls.append((request.draft_step_id, list(request.num_draft_tokens)))
            return await verify(request, context)

        harness.verifier.Verify = recording_verify
        async with harness as h:
            h.scheduler.chooser = RaggedK(h.scheduler.spec_stats, 4)
            results = await asyncio.gather(*(h.generate(rid, p, temperature=0.5, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, _, usage) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            per_step = collections.Counter(step for step, _ in calls)
            assert per_step and max(per_step.values()) == 1, per_step  # one Verify call per drafter step
            assert sum(len(set(ks)) > 1 for _, ks in calls) >= 3, calls  # ... holding rows of different k_i
            recent = [s for s in h.scheduler.totals.recent if s.num_draft_tokens]
            assert any(s.num_draft_tokens not in (s.k * n for n in range(s.num_verify + 1)) for s in recent)
            usage_drafts = sum(r[2].num_draft_tokens for r in results)
            assert usage_drafts == sum(sum(ks) for _, ks in calls)  # each request counted at its own k_i

    asyncio.run(main())
