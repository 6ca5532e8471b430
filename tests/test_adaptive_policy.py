"""Adaptive k in a closed loop on synthetic timing traces (``coordinator.adaptive``,
``coordinator.cost_model``): the policy picks k, a synthetic drafter/verifier "runs" the step
with known costs and acceptance, and the policy learns from what it measured. Checks the per-k
verify fit (rows and draft positions kept apart), exploration of unmeasured k, Lemma 2 of the
MineDraft paper (flat verify: k grows until t_draft reaches t_verify), a compute-bound verify
(small k), no acceptance (smallest k, or no draft at all in sd) and the per-request k = 0 choice
that weighs the extra Verify call."""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable

import pytest

from coordinator.adaptive import NO_DRAFT, AdaptiveConfig, KChooser, KPolicy, SpeculationStats
from coordinator.cost_model import StepCostModel

CostFn = Callable[[int, int], float]  # (rows n, k) -> ms
NUM_STEPS = 240


def _accepted(rng: random.Random, alpha: float, k: int) -> int:
    """Accepted draft tokens of one verify: each accepted with probability alpha until a rejection."""
    num = 0
    while num < k and rng.random() < alpha:
        num += 1
    return num


def _simulate(draft: CostFn, verify: CostFn, alphas: dict[str, float], max_k: int, is_parallel: bool = True,
              num_steps: int = NUM_STEPS, seed: int = 0,
              step_overhead_ms: float = 0.0) -> tuple[KChooser, list[dict[str, int]]]:
    """Run ``num_steps`` steps of one batch; returns the chooser and each step's k per request.
    As the engines do with ragged rows: one Draft call of max k_i steps, one Verify call of the
    drafted requests timed at their widest row (``verify(n, max k_i)``), one with k = 0. Each
    step's wall time is its critical compute plus ``step_overhead_ms`` (RPCs, the coordinator)."""
    stats = SpeculationStats(AdaptiveConfig())
    chooser, rng, history = KChooser(KPolicy.ADAPTIVE, max_k, stats), random.Random(seed), []
    for _ in range(num_steps):
        ks = chooser.draft_ks(list(alphas), is_parallel)
        drafted = [rid for rid, k in ks.items() if k > 0]
        groups = collections.Counter(max(ks[rid] for rid in drafted) if k > 0 else 0 for k in ks.values())
        t_draft = t_verify = 0.0
        if drafted:
            k_max = max(ks[rid] for rid in drafted)
            t_draft = draft(len(drafted), k_max)
            stats.cost.observe_draft(len(drafted), k_max, t_draft)
        for k, n in groups.items():
            t_call = verify(n, k)
            stats.cost.observe_verify(n, k, t_call)
            t_verify += t_call
        critical = max(t_draft, t_verify) if is_parallel else t_draft + t_verify
        stats.cost.observe_step(critical + step_overhead_ms, critical)
        stats.observe_call([(rid, k, _accepted(rng, alphas[rid], k)) for rid, k in ks.items()])  # as stepping does
        history.append(ks)
    return chooser, history


def _settled_k(history: list[dict[str, int]], request_id: str = "r0") -> int:
    """The most frequent k of ``request_id`` over the last half of the run (exploration aside)."""
    return collections.Counter(ks[request_id] for ks in history[len(history) // 2:]).most_common(1)[0][0]


def _batch(alpha: float, n: int = 4) -> dict[str, float]:
    return {f"r{i}": alpha for i in range(n)}


def test_verify_fit_is_per_k_and_fills_unmeasured_k_from_neighbours() -> None:
    cost = StepCostModel(decay=0.95)
    for n in (2, 4):
        cost.observe_verify(n, 4, 100.0 + 20.0 * n)  # rows cost, k = 4
    assert cost.verify_ms(4, 4) == pytest.approx(180.0)
    assert cost.verify_ms(4, 1) == pytest.approx(180.0)  # one k measured: flat (optimistic) guess
    for n in (2, 4):
        cost.observe_verify(n, 2, 90.0 + 20.0 * n)
    assert cost.verify_ms(4, 3) == pytest.approx(175.0)  # between k = 2 and 4
    assert cost.verify_ms(4, 6) == pytest.approx(190.0)  # beyond: the slope of the two nearest
    assert cost.verify_ms(4, 0) == pytest.approx(160.0)  # below: same slope, above the position share
    steep = StepCostModel()
    for k in (3, 4):
        steep.observe_verify(4, k, 10.0 * 4 * (k + 1))  # compute-bound: proportional to positions
    assert steep.verify_ms(4, 0) == pytest.approx(40.0)  # floor: t(3) * 1 / 4, not the line's 0
    assert steep.num_draft_calls == 0 and not steep.is_known


def test_draft_fit_is_per_k_and_keeps_a_call_s_fixed_part() -> None:
    cost = StepCostModel(decay=0.95)
    for n in (16, 32):
        cost.observe_draft(n, 4, 12.0 + 0.3 * n + 4 * 2.0)
    assert cost.draft_ms(32, 4) == pytest.approx(29.6)
    assert cost.draft_ms(32, 2) == pytest.approx(14.8)   # one k measured: k forwards (proportional)
    for n in (16, 32):
        cost.observe_draft(n, 1, 12.0 + 0.3 * n + 1 * 2.0)
    assert cost.draft_ms(32, 1) == pytest.approx(23.6)
    assert cost.draft_ms(32, 2) == pytest.approx(25.6)   # between k = 1 and 4: the call's fixed part kept
    assert cost.draft_ms(32, 6) == pytest.approx(33.6)   # beyond: the slope of the two nearest
    assert cost.is_measured(4) is False                  # no Verify call at k = 4 yet
    cost.observe_verify(32, 4, 12.0)
    assert cost.is_measured(4) and cost.is_known


def test_draft_calls_with_a_fixed_part_keep_k_large() -> None:
    """The vLLM drafter on one H200 under MPS (bench/results/HISTORY.md, session 22): a Draft call of 32
    rows is a fixed 17.5 ms (admission, catch-up step, the shared GPU) plus 3.1 ms a draft
    token; verify 12 ms, 5 ms a step beyond the engines, alpha 0.7. Goodput per k: 1.70 / 25.6,
    2.19 / 28.7, 2.53 / 31.8, 2.77 / 34.9 tokens per ms and row: k = 3 (k = 4 within 0.4%).
    Modelled as k forwards of 20.6 ms at k = 1, k = 4 looked like 82 ms, and the loop stayed at k = 1."""
    _, history = _simulate(lambda n, k: 17.5 + 3.1 * k, lambda n, k: 12.0, _batch(0.7, n=32), max_k=4,
                           step_overhead_ms=5.0)
    widths = [{"r0": max(ks.values())} for ks in history]
    assert _settled_k(widths) in (3, 4)


def test_a_draft_call_far_slower_than_the_verify_settles_at_a_shorter_k() -> None:
    """The vLLM drafter with resident sessions on one H100 under MPS (BENCHMARKS.md, session 30, c = 64):
    a Draft call of 32 rows is 15.9 ms at k = 1 (admission, the catch-up step beside the verifier's
    forward) plus 5.1 ms a further draft token; verify 16.8 ms, 4.6 ms a step beyond the engines,
    alpha 0.7. Goodput per k: 1.70 / 21.4, 2.19 / 25.6, 2.53 / 30.7, 2.77 / 35.8 tokens per ms and
    row: k = 2, 10% above the fixed k = 4 that session 30 ran."""
    _, history = _simulate(lambda n, k: 10.8 + 5.1 * k, lambda n, k: 16.8, _batch(0.7, n=32), max_k=4,
                           step_overhead_ms=4.6)
    widths = [{"r0": max(ks.values())} for ks in history]
    assert _settled_k(widths) == 2


def test_flat_verify_grows_k_until_draft_time_reaches_verify_time() -> None:
    """Lemma 2: verify 180 ms whatever k (memory-bound), 9 ms per draft forward of 4 rows: psd
    settles on the largest k with t_draft <= t_verify's neighbourhood, here k = 8 of k_max 8
    (t_draft 72 < 180) -- the CPU case where the old positions fit chose k = 1."""
    chooser, history = _simulate(lambda n, k: 9.0 * k, lambda n, k: 60.0 + 30.0 * n, _batch(0.8), max_k=8)
    assert _settled_k(history) == 8
    level, _ = _simulate(lambda n, k: 36.0 * k, lambda n, k: 180.0, _batch(0.8), max_k=8)
    k = level.batch_k(4, is_parallel=True)  # t_draft(k) = 36 k reaches 180 ms at k = 5
    assert _settled_k(_simulate(lambda n, k: 36.0 * k, lambda n, k: 180.0, _batch(0.8), max_k=8)[1]) == 5
    assert math.isclose(level.stats.cost.draft_ms(4, 5), level.stats.cost.verify_ms(4, 5), rel_tol=1e-6)
    assert k in (4, 5, 6)  # 5, or a neighbour on an exploration call


@pytest.mark.parametrize("before_ms, after_ms, k_before, k_after", [(60.0, 120.0, 7, 13), (120.0, 60.0, 13, 7)])
def test_k_follows_a_load_change(before_ms: float, after_ms: float, k_before: int, k_after: int) -> None:
    """The verifier's cost (flat in k) doubles or halves mid-run (another tenant, longer
    contexts): k moves to the new level point of 9 ms a draft forward (alpha 0.9)."""
    num_calls = [0]

    def verify(n: int, k: int) -> float:
        num_calls[0] += 1
        return before_ms if num_calls[0] <= 200 else after_ms

    _, history = _simulate(lambda n, k: 9.0 * k, verify, _batch(0.9), max_k=16, num_steps=400)
    widths = [{"r0": max(ks.values())} for ks in history]  # the Draft call's k (rows may draft fewer)
    assert _settled_k(widths[:200]) == k_before and _settled_k(widths[200:]) == k_after


def test_compute_bound_verify_keeps_k_small() -> None:
    """Verify cost proportional to scored positions (no fixed part): a draft token costs what a
    decoded token does, so at alpha 0.5 the best k is 1 -- found although the loop starts at k_max."""
    _, history = _simulate(lambda n, k: 0.5 * k, lambda n, k: 10.0 * n * (k + 1), _batch(0.5), max_k=6)
    assert history[0]["r0"] == 6 and _settled_k(history) == 1
    assert sum(ks["r0"] > 2 for ks in history[len(history) // 2:]) == 0


def test_no_acceptance_drafts_the_fewest_tokens_or_none() -> None:
    """Drafts always rejected. psd with a verify flat in k (drafting hidden, draft positions
    free): k = 1. sd (drafting on the critical path), or psd with a verify that grows in k: no
    draft at all, every request verified as plain decode (k = 0)."""
    flat, grows = (lambda n, k: 100.0 + 20.0 * n), (lambda n, k: 100.0 + 5.0 * n * (k + 1))
    assert _settled_k(_simulate(lambda n, k: 9.0 * k, flat, _batch(0.0), max_k=4)[1]) == 1
    for verify, is_parallel in ((flat, False), (grows, True)):
        _, history = _simulate(lambda n, k: 9.0 * k, verify, _batch(0.0), max_k=4, is_parallel=is_parallel)
        late = history[len(history) // 2:]
        assert sum(all(k == NO_DRAFT for k in ks.values()) for ks in late) > 0.8 * len(late)


def test_low_acceptance_request_left_undrafted_only_when_the_extra_call_pays() -> None:
    """One request whose drafts are always rejected among three good ones. A CPU-like verifier
    (a Verify call costs 100 ms + 20 ms a row, flat in k) keeps it in the one call, as a ragged
    row of k_i = 1 next to the good ones' k = 4; a verifier whose cost is all per position (no
    fixed part) verifies it separately at k = 0."""
    alphas = {"r0": 0.8, "r1": 0.8, "r2": 0.8, "bad": 0.0}
    _, cpu = _simulate(lambda n, k: 5.0 * k, lambda n, k: 100.0 + 20.0 * n, alphas, max_k=4)
    assert _settled_k(cpu, "bad") == 1 and _settled_k(cpu, "r0") == 4
    _, positions = _simulate(lambda n, k: 1.0 * k, lambda n, k: 10.0 * n * (k + 1), alphas, max_k=4)
    late = positions[len(positions) // 2:]
    assert sum(ks["bad"] == NO_DRAFT for ks in late) > 0.7 * len(late)
    assert _settled_k(positions, "r0") >= 1


def test_exploration_is_paced_and_prefers_unmeasured_neighbours() -> None:
    stats = SpeculationStats(AdaptiveConfig(explore_every_steps=4))
    chooser = KChooser(KPolicy.ADAPTIVE, 6, stats)
    stats.cost.observe_verify(4, 3, 50.0)
    for _ in range(3):
        stats.cost.observe_draft(4, 3, 3 * 50.0 / 3)  # t_draft(3) = t_verify: k = 3 is best
    assert stats.cost.num_draft_calls == 3
    explored = chooser.batch_k(4, is_parallel=True)
    assert explored in (2, 4) and explored not in stats.cost.verify_by_k
    stats.cost.observe_draft(4, 3, 50.0)
    assert chooser.batch_k(4, is_parallel=True) == 3  # the next three calls: the best k
    assert KChooser(KPolicy.FIXED, 6, stats).batch_k(4, is_parallel=True) == 6
    with pytest.raises(ValueError, match="explore_every_steps"):
        AdaptiveConfig(explore_every_steps=1)


def test_fixed_step_overhead_favours_the_longer_draft() -> None:
    """A GPU-like psd batch of 16 rows: drafting hidden (1.8 ms a forward), verify 5% dearer at
    k = 4 than at k = 3 (9.45 vs 9.0 ms), alpha 0.6 (k = 4 commits about 6% more tokens). On
    engine compute alone k = 4 is within the 1% tie tolerance of k = 3, so the smaller k is
    taken (most calls; the estimate of alpha wanders around the tie); once each step is measured
    to spend 6 ms outside the engines (RPCs, the coordinator; 3-4 ms on the 2x H200 of
    BENCHMARKS.md), the 0.45 ms is a 3% dearer step and k = 4 wins on every call but exploration."""
    alphas = {f"r{i}": 0.6 for i in range(16)}
    def verify(n, k): return 7.65 + 0.45 * k + 0.001 * n  # noqa: E306
    def draft(n, k): return 1.8 * k  # noqa: E306
    def share_of_k4(history):  # Draft calls at k = 4 over the run's second half  # noqa: E306
        widths = [max(ks.values()) for ks in history[len(history) // 2:]]
        return sum(k == 4 for k in widths) / len(widths)
    for seed in range(3):
        level, history = _simulate(draft, verify, alphas, max_k=4, seed=seed)
        assert level.stats.cost.overhead_ms == 0.0 and share_of_k4(history) < 0.6  # near the tie: k = 3 mostly
        loaded, history = _simulate(draft, verify, alphas, max_k=4, step_overhead_ms=6.0, seed=seed)
        assert loaded.stats.cost.overhead_ms == pytest.approx(6.0)
        assert loaded.batch_k(16, is_parallel=True) == 4 and share_of_k4(history) > 0.8  # all but exploration


def test_step_overhead_is_the_decayed_mean_beyond_critical_compute() -> None:
    cost = StepCostModel(decay=0.5)
    assert cost.overhead_ms == 0.0  # before any step
    cost.observe_step(14.0, 10.0)
    assert cost.overhead_ms == pytest.approx(4.0)
    cost.observe_step(12.0, 10.0)
    assert cost.overhead_ms == pytest.approx((0.5 * 4.0 + 2.0) / 1.5)
    cost.observe_step(5.0, 10.0)  # engine time measured beyond the wall (clock skew): no negative overhead
    assert cost.overhead_ms >= 0.0


def test_batch_acceptance_ages_per_verify_call_not_per_request() -> None:
    """16 rows of one Verify call all count at today's weight; the past decays once per call,
    so one call of 16 rejected drafts cannot wipe out what the calls before it measured."""
    stats = SpeculationStats(AdaptiveConfig(decay=0.9))
    for _ in range(20):  # 20 calls of 16 rows, 3 of 4 accepted
        stats.observe_call([(f"r{i}", 4, 3) for i in range(16)])
    before = stats.acceptance.alpha
    stats.observe_call([(f"r{i}", 4, 0) for i in range(16)])  # one bad call
    assert before == pytest.approx(0.75, abs=0.01)
    assert stats.acceptance.alpha > 0.7  # aged per row, 16 rejections would pull it to about 0.5
    assert stats.request_alpha("r0") < before  # each request's own estimate still ages per draft
    one_by_one, as_calls = SpeculationStats(), SpeculationStats()  # a call of one row = one observe_verified
    for k, accepted in ((4, 2), (3, 3), (4, 0)):
        one_by_one.observe_verified("a", k, accepted)
        as_calls.observe_call([("a", k, accepted)])
    assert one_by_one.acceptance.alpha == as_calls.acceptance.alpha != one_by_one.cfg.prior_alpha
    assert one_by_one.request_alpha("a") == as_calls.request_alpha("a")
