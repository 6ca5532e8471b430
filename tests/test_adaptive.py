"""Adaptive k (``coordinator.adaptive``, ``coordinator.cost_model``): policy units, and the step
loop against the fake engines of ``test_coordinator`` with k changing mid-request (greedy output
must stay the reference's; the fake verifier checks each Verify carries exactly the drafts last
made for every request at its current length)."""

from __future__ import annotations

import asyncio
import math

import pytest
from test_coordinator import VOCAB, FakeDrafter, Harness, _expected, _workload, toy_next

from coordinator.adaptive import NO_DRAFT, AdaptiveConfig, KChooser, KPolicy, SpeculationStats
from coordinator.config import CoordinatorConfig
from coordinator.engines import decode_token_ids, encode_token_ids
from coordinator.cost_model import AcceptanceEstimate, LinearFit, StepCostModel, expected_tokens
from minedraft.v1 import engine_pb2


def test_expected_tokens_matches_the_closed_form() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert math.isclose(expected_tokens(0.5, 3), 1 + 0.5 + 0.25 + 0.125)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError, match="k"):
        expected_tokens(0.5, -1)


def test_linear_fit_recovers_a_line_and_is_optimistic_without_a_slope() -> None:
    fit = LinearFit(decay=0.95)
    fit.observe(4, 10.0)
    assert fit.coefficients() == (10.0, 0.0) and fit.predict(8) == 10.0 and fit.predict(2) == 5.0  # one x: the
    # cheapest line through it (flat above, proportional below)
    for x in (2, 6, 3, 8, 5):
        fit.observe(x, 3.0 + 0.5 * x)
    fit2 = LinearFit(decay=0.95)
    for x in (2, 6, 3, 8, 5, 1):
        fit2.observe(x, 3.0 + 0.5 * x)
    a, b = fit2.coefficients()
    assert math.isclose(a, 3.0, abs_tol=1e-6) and math.isclose(b, 0.5, abs_tol=1e-6)
    flat = LinearFit()
    for x in (1, 5, 9):
        flat.observe(x, 7.0)
    assert math.isclose(flat.predict(100), 7.0, abs_tol=1e-6)  # memory-bound: flat in work


def test_acceptance_estimate_is_the_truncated_geometric_mle() -> None:
    est = AcceptanceEstimate(prior_alpha=0.5, prior_weight=1e-9, decay=0.999999)
    for accepted in (2, 4, 0, 1):  # k = 4: rejections after 2, none (all 4 accepted), 0 and 1
        est.observe(4, accepted)
    assert math.isclose(est.alpha, 7 / (7 + 3), rel_tol=1e-4)


def _stats(draft_ms_per_token: float, verify_ms: float, alpha_accepts: int, k: int = 4) -> SpeculationStats:
    """Stats after steps with a flat verifier, a drafter linear in k, acceptance from counts."""
    stats = SpeculationStats(AdaptiveConfig())
    for n, k_seen in ((4, 1), (4, 2), (4, 3), (4, 4), (8, 2), (8, 4)):
        stats.cost.observe_draft(n, k_seen, draft_ms_per_token * k_seen)
        stats.cost.observe_verify(n, k_seen, verify_ms)
    for i in range(40):
        stats.observe_verified(f"r{i % 4}", k, alpha_accepts)
    return stats


def test_adaptive_k_levels_draft_and_verify_time_in_psd() -> None:
    """Lemma 2: with verify 8 ms flat, 2 ms per draft token, psd picks k = 4 (t_draft = t_verify)."""
    stats = _stats(draft_ms_per_token=2.0, verify_ms=8.0, alpha_accepts=3, k=8)
    chooser = KChooser(KPolicy.ADAPTIVE, 8, stats)
    k = chooser.batch_k(4, is_parallel=True)
    assert k == 4 and math.isclose(stats.cost.draft_ms(4, k), stats.cost.verify_ms(4, k), rel_tol=1e-6)
    assert chooser.batch_k(4, is_parallel=False) < k  # sd pays t_draft + t_verify: shorter drafts
    slow_drafter = KChooser(KPolicy.ADAPTIVE, 8, _stats(draft_ms_per_token=8.0, verify_ms=8.0, alpha_accepts=3, k=8))
    assert slow_drafter.batch_k(4, is_parallel=True) == 1
    assert KChooser(KPolicy.FIXED, 8, stats).batch_k(4, is_parallel=True) == 8


def test_request_whose_drafts_are_rejected_is_not_drafted_until_a_probe() -> None:
    stats = SpeculationStats(AdaptiveConfig(probe_every_steps=3))
    chooser = KChooser(KPolicy.ADAPTIVE, 4, stats)
    for _ in range(30):
        stats.observe_verified("good", 4, 3)
        stats.observe_verified("bad", 4, 0)
    assert chooser.request_k("good", 4) == 4 and chooser.request_k("bad", 4) == NO_DRAFT
    for _ in range(3):
        stats.observe_verified("bad", NO_DRAFT, 0)
    assert chooser.request_k("bad", 4) == 4  # probe
    stats.forget("bad")
    assert chooser.request_k("bad", 4) == 4  # a new request starts from the batch's acceptance
    assert KChooser(KPolicy.FIXED, 4, stats).request_k("bad", 4) == 4


@pytest.mark.parametrize("bad", [{"decay": 1.0}, {"min_request_alpha": 1.0}, {"probe_every_steps": 0},
                                 {"prior_alpha": 0.0}])
def test_adaptive_config_validation_names_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        AdaptiveConfig(**bad)
    with pytest.raises(ValueError, match="k_policy"):
        CoordinatorConfig(k_policy="sometimes")


class TimedDrafter(FakeDrafter):
    """Reports ``ms_per_token * k`` as draft time; requests named ``bad-*`` always draft wrong."""

    ms_per_token = 3.0

    async def Draft(self, request, context):
        response = await super().Draft(request, context)
        k = request.num_speculative_tokens
        response.draft_ms = self.ms_per_token * k
        rows = [list(row) for row in _rows(response)]
        for seq, row, k_i in zip(request.seqs, rows, response.num_draft_tokens):
            if seq.request_id.startswith("bad"):
                known = self.known[seq.request_id]
                row[:k_i] = [(toy_next(known + row[:i]) + 1) % VOCAB for i in range(k_i)]
                self.last_drafts[seq.request_id] = (len(known), row[:k_i])
        response.draft_token_ids.CopyFrom(encode_token_ids(rows))
        return response


class TimedHarness(Harness):
    """``ms_per_position`` > 0: the verifier reports that many ms per scored position (a
    compute-bound verifier, where leaving a rejected request undrafted pays for its own call)."""

    def __init__(self, ms_per_position: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drafter = TimedDrafter(self.verifier, 0.8, 0.001)
        if ms_per_position > 0:
            verify = self.verifier.Verify

            async def timed_verify(request, context):
                response = await verify(request, context)
                k = request.draft_token_ids.shape[1] if len(request.draft_token_ids.shape) > 1 else 0
                ks = list(request.num_draft_tokens) or [k] * len(request.request_ids)
                response.verify_ms = ms_per_position * sum(k_i + 1 for k_i in ks)  # ragged feed
                return response

            self.verifier.Verify = timed_verify


def _rows(response: engine_pb2.DraftResponse) -> list[list[int]]:
    return decode_token_ids(response.draft_token_ids)


@pytest.mark.parametrize("mode", ["sd", "psd"])
def test_adaptive_k_changes_mid_request_and_output_stays_exact(mode: str) -> None:
    work = _workload(12) + [("bad-0", [4, 9, 2], {"max_tokens": 40, "ignore_eos": True})]

    async def main():
        async with TimedHarness(mode=mode, max_num_seqs=3, num_speculative_tokens=6, k_policy="adaptive",
                                delay_s=0.004, ms_per_position=1.0) as h:
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, usage) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            ks = {s.k for s in h.scheduler.totals.recent if s.num_draft_tokens}
            assert len(ks) >= 2 and max(ks) <= 6, ks
            bad_usage = results[-1][2]
            assert bad_usage.num_drafts < 40 // 2, bad_usage  # mostly undrafted after a few misses

    asyncio.run(main())


@pytest.mark.parametrize("data_plane", ["inline", "dist"])
def test_sampled_draft_probs_follow_their_requests_while_k_changes(data_plane: str) -> None:
    """Sampled requests: each Verify carries, per request, the [k, V] probs rows of the drafts it
    carries (checked by the fake verifier), with k changing, one request undrafted and the
    feedback balancer moving requests."""
    work = _workload(10) + [("bad-1", [6, 2, 9], {"max_tokens": 30, "ignore_eos": True})]

    async def main():
        async with TimedHarness(mode="psd", max_num_seqs=3, num_speculative_tokens=5, k_policy="adaptive",
                                balancer="feedback", data_plane=data_plane, delay_s=0.004) as h:
            results = await asyncio.gather(*(h.generate(rid, p, temperature=0.8, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, _, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            ks = {s.k for s in h.scheduler.totals.recent if s.num_draft_tokens}
            assert len(ks) >= 2, ks
            if data_plane == "inline":
                assert h.verifier.num_prob_rows > 0 and h.verifier.num_dist_fetches == 0
            else:
                assert h.verifier.num_dist_fetches > 0 and h.verifier.num_prob_rows == 0

    asyncio.run(main())
