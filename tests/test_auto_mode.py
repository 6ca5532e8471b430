"""``--mode auto`` (``coordinator.auto_mode``): decisions from online timings and acceptance, and
the step loop switching modes on the fake engines of ``test_coordinator`` with exact outputs."""

from __future__ import annotations

import asyncio

import pytest
from test_adaptive import TimedHarness
from test_coordinator import _expected, _workload, wait_until

from coordinator.adaptive import KChooser, SpeculationStats
from coordinator.auto_mode import REASON_KEPT, REASON_NO_DRAFTER, REASON_PROBE, AutoConfig, AutoMode
from coordinator.config import CoordinatorConfig, Mode
from minedraft.v1 import coordinator_pb2

M = 4


def _auto(draft: tuple[float, float], verify_fixed_ms: float, verify_ms_per_position: float, accepted_of_4: int,
          policy: str = "fixed", **cfg) -> AutoMode:
    """An AutoMode whose estimates saw steps of a drafter taking ``draft[0] + draft[1] * n`` ms per
    draft forward of n rows, a verifier taking ``fixed + per_position * positions`` ms, and
    ``accepted_of_4`` of 4 draft tokens accepted."""
    stats = SpeculationStats()
    for n, k in ((2, 4), (4, 4), (8, 4), (4, 2), (8, 0), (4, 0)):
        if k:
            stats.cost.observe_draft(n, k, (draft[0] + draft[1] * n) * k)
        stats.cost.observe_verify(n, k, verify_fixed_ms + verify_ms_per_position * n * (k + 1))
    for i in range(50):
        stats.observe_verified(f"r{i % 8}", 4, accepted_of_4)
    return AutoMode(KChooser(policy, 4, stats), M, AutoConfig(**cfg))


def test_picks_ar_when_drafts_are_always_rejected() -> None:
    decision = _auto((2.0, 0.0), 8.0, 0.0, accepted_of_4=0).choose((4, 4), 0, True)
    assert decision.mode == Mode.AR and decision.goodput["ar"] > decision.goodput["psd"]


def test_picks_psd_when_drafting_and_verification_are_level() -> None:
    auto = _auto((0.0, 0.5), 6.0, 0.1, accepted_of_4=3)
    decision = auto.choose((4, 4), 0, True)
    cost = auto.chooser.stats.cost
    assert cost.draft_ms(4, 4) == pytest.approx(cost.verify_ms(4, 4)) == pytest.approx(8.0)  # level at k = 4
    assert decision.mode == Mode.PSD and decision.goodput["psd"] > max(decision.goodput["sd"], decision.goodput["ar"])


def test_picks_sd_with_one_request() -> None:
    decision = _auto((2.0, 0.0), 8.0, 0.0, accepted_of_4=3).choose((1, 0), 0, True)
    assert decision.mode == Mode.SD and "psd" not in decision.goodput


def test_speculation_off_when_verification_is_compute_bound() -> None:
    """Verify time proportional to scored positions: every draft token costs a decoded token."""
    decision = _auto((0.5, 0.0), 0.0, 1.0, accepted_of_4=3).choose((4, 4), 0, True)
    assert decision.mode == Mode.AR


def test_ar_probes_speculation_and_a_small_gain_does_not_switch() -> None:
    auto = _auto((2.0, 0.0), 8.0, 0.0, accepted_of_4=0, probe_every_steps=3)
    assert [auto.choose((4, 4), 0, True).reason for _ in range(5)][3] == REASON_PROBE
    assert auto.current == Mode.AR
    assert auto.choose((4, 4), 0, False).reason == REASON_NO_DRAFTER
    level = _auto((2.0, 0.0), 8.0, 0.0, accepted_of_4=3, margin=10.0)
    level.current = Mode.SD
    assert level.choose((4, 4), 0, True).reason == REASON_KEPT


def test_auto_config_and_mode_validation() -> None:
    with pytest.raises(ValueError, match="margin"):
        AutoConfig(margin=-1)
    with pytest.raises(ValueError, match="probe_every_steps"):
        AutoConfig(probe_every_steps=0)
    cfg = CoordinatorConfig(mode="auto", max_num_seqs=3)
    assert cfg.max_num_running == 6 and cfg.uses_batches and cfg.uses_drafter


@pytest.mark.parametrize("accuracy", [0.0, 0.9])
def test_step_loop_in_auto_mode_switches_and_stays_exact(accuracy: float) -> None:
    """Drafts always wrong: auto settles on ar (with sd probes); mostly right: it speculates.

    Verify takes 40 ms so that the event-loop and RPC overhead of a loaded host (tens of ms a
    step under two xdist workers on two cores) stays a fraction of a step: at 10 ms it dominated
    the wall times, the calibrations hit their floor and auto flapped (CI failure of session 19)."""
    work = _workload(14)

    async def main():
        async with TimedHarness(mode="auto", max_num_seqs=3, num_speculative_tokens=3, delay_s=0.04,
                                balancer="feedback") as h:
            h.drafter.accuracy, h.drafter.ms_per_token = accuracy, 4.0  # verify 40 ms, drafting 4 ms a token
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            modes = [s.mode for s in h.scheduler.totals.recent]
            decisions = {mode: 0.0 for mode in ("ar", "sd", "psd")}
            for metric in h.scheduler.metrics.auto_decisions.collect():
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        decisions[sample.labels["mode"]] += sample.value
            assert decisions == {mode: modes.count(mode) for mode in decisions}, (decisions, modes)
            if accuracy == 0.0:  # starts speculating (no timings yet), then switches to ar
                assert len(set(modes)) >= 2 and modes.count("ar") > len(modes) // 2, modes
            else:  # sd or psd (which one depends on how many requests arrived before the first step)
                assert modes.count("ar") < len(modes) // 2, modes
            status = await h.stub.GetStatus(coordinator_pb2.StatusRequest())
            assert status.mode == "auto" and status.effective_mode in ("ar", "sd", "psd")

    asyncio.run(main())


def test_minedraft_up_and_demo_pass_auto_adaptive_and_balancer_to_the_coordinator() -> None:
    from coordinator.__main__ import parse_args
    from minedraft.cli import build_parser, stack_config
    from minedraft.stack import StackConfig, coordinator_spec

    args = build_parser().parse_args(["demo", "--modes", "psd,auto", "--k-policy", "adaptive", "--balancer", "feedback"])
    for mode in ("psd", "auto"):
        spec = coordinator_spec(stack_config(args, mode))
        cfg = parse_args(spec.argv[3:])
        assert (cfg.mode, cfg.k_policy, cfg.balancer) == (mode, "adaptive", "feedback")
        assert cfg.max_num_batched_tokens == 4096   # the stack's CPU default reaches the coordinator
    args = build_parser().parse_args(["up", "--max-num-batched-tokens", "512"])
    assert parse_args(coordinator_spec(stack_config(args, "ar")).argv[3:]).max_num_batched_tokens == 512
    assert stack_config(args, "auto").has_drafter
    with pytest.raises(ValueError, match="k_policy"):
        StackConfig(k_policy="sometimes")


def test_auto_outside_psd_keeps_admitting_up_to_2m() -> None:
    """In ar/sd steps the batches do not swap roles: newcomers are spread over both batches, so
    admission is not capped by one batch filling up."""
    from coordinator.finish import FinishParams
    from coordinator.request import RequestState, RequestStatus
    from minedraft.v1 import common_pb2

    work = [(f"req-{i}", [3 + i % 9, 5 + (i * 3) % 13], {"max_tokens": 300 if i < 4 else 30, "ignore_eos": True})
            for i in range(6)]
    requests = []
    for rid, prompt, sampling in work:
        params = common_pb2.SamplingParams(**sampling)
        requests.append(RequestState(rid, prompt, params, FinishParams.from_params(params)))

    async def main():
        async with TimedHarness(mode="auto", max_num_seqs=3, num_speculative_tokens=3, delay_s=0.004) as h:
            h.drafter.accuracy = 0.0  # auto settles on ar
            for request in requests[:4]:  # > m at once: the first step (no timings yet) is psd
                h.scheduler.submit(request)
            await wait_until(lambda: h.scheduler.totals.num_steps > 20)
            assert h.scheduler.totals.recent[0].mode == "psd" and h.scheduler.effective_mode == Mode.AR
            assert len(h.scheduler.running) == 4
            for request in requests[4:]:
                h.scheduler.submit(request)
            await wait_until(lambda: not h.scheduler.waiting)
            assert len(h.scheduler.running) == 6 and max(h.scheduler.batches.batch_sizes()) <= 3
            await wait_until(lambda: all(r.status == RequestStatus.FINISHED for r in requests))
            for (rid, prompt, sampling), request in zip(work, requests):
                assert request.output_token_ids == _expected(prompt, sampling), rid

    asyncio.run(main())


def test_auto_running_ar_admits_without_the_drafter_and_adds_on_first_draft(monkeypatch) -> None:
    """Newcomers admitted while auto runs ``ar`` skip the drafter's prefill (``ar`` never waits for
    it); the first sd/psd step that drafts them adds them with their committed tokens (the fake
    drafter asserts the catch-up protocol on every Draft); outputs stay exact."""
    from coordinator_harness import FakeDrafter

    work = [(f"req-{i}", [3 + i, 7 + (2 * i) % 11], {"max_tokens": 400 if i < 2 else 300, "ignore_eos": True})
            for i in range(5)]
    adds: list[tuple[str, int]] = []   # (request id, output tokens committed when it was added)
    scheduler = {}
    add_requests = FakeDrafter.AddRequests

    async def recording_add(self, request, context):
        running = scheduler["s"].running
        adds.extend((s.request_id, len(running[s.request_id].output_token_ids)) for s in request.seqs)
        return await add_requests(self, request, context)

    monkeypatch.setattr(FakeDrafter, "AddRequests", recording_add)

    async def main():
        async with TimedHarness(mode="auto", max_num_seqs=3, num_speculative_tokens=3, delay_s=0.004) as h:
            scheduler["s"] = h.scheduler
            h.drafter.accuracy = 0.0  # auto settles on ar and probes sd/psd now and then
            first = [asyncio.create_task(h.generate(rid, p, **s)) for rid, p, s in work[:2]]
            await wait_until(lambda: h.scheduler.totals.num_steps > 20 and h.scheduler.effective_mode == Mode.AR)
            later = [asyncio.create_task(h.generate(rid, p, **s)) for rid, p, s in work[2:]]
            results = await asyncio.gather(*first, *later)
            for (rid, prompt, sampling), (tokens, _, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            late_ids = {rid for rid, _, _ in work[2:]}
            assert [n for rid, n in adds if rid in late_ids and n == 0] == [], adds   # none at admission
            assert {rid for rid, _ in adds} & late_ids, adds   # ... but added when a probe drafted them
            assert h.scheduler.metrics.num_lazy_drafter_adds._value.get() >= len({r for r, _ in adds} & late_ids)

    asyncio.run(main())
