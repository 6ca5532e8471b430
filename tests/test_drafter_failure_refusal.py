"""A drafter that refuses one request (not a transport error) against the fake engines
(tests/coordinator_harness.py): only that request runs without speculation; the others keep
speculating and every output stays the target's. Transport failures (UNAVAILABLE) keep the ``ar``
fallback of coordinator.fallback (tests/test_coordinator_faults.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator_harness import FakeDrafter, Harness, _expected, _workload, wait_until

BAD_ID = "refused"
BAD_SAMPLING = {"max_tokens": 200, "ignore_eos": True}  # outlives the others


class RefusingDrafter(FakeDrafter):
    """Refuses every AddRequests batch that holds ``BAD_ID``, all or nothing like the real drafter."""

    async def AddRequests(self, request, context):
        if any(seq.request_id == BAD_ID for seq in request.seqs):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "draft KV full")
        return await super().AddRequests(request, context)


def _refusing_harness(**cfg) -> Harness:
    harness = Harness(**cfg)
    harness.drafter = RefusingDrafter(harness.verifier, accuracy=0.7, delay_s=harness.verifier.delay_s)
    return harness


def _watch_losses(scheduler) -> list[BaseException]:
    losses, original = [], scheduler._lose_drafter

    def recorded(exc):
        losses.append(exc)
        original(exc)

    scheduler._lose_drafter = recorded
    return losses


async def _run(h: Harness, work) -> list:
    bad = asyncio.create_task(h.generate(BAD_ID, [7, 8, 9], **BAD_SAMPLING))
    results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
    return [await bad] + results


def _check(results, work) -> None:
    (bad_tokens, bad_reason, bad_usage), *others = results
    assert bad_tokens == _expected([7, 8, 9], BAD_SAMPLING) and bad_reason == "length"
    assert bad_usage.num_draft_tokens == 0  # it ran undrafted
    for (rid, prompt, sampling), (tokens, _, usage) in zip(work, others):
        assert tokens == _expected(prompt, sampling), rid


@pytest.mark.parametrize("mode", ["sd", "psd"])
def test_a_request_the_drafter_refuses_runs_undrafted_and_the_others_keep_speculating(mode) -> None:
    work = _workload(6)

    async def main():
        async with _refusing_harness(mode=mode, max_num_seqs=4, delay_s=0.005) as h:
            losses = _watch_losses(h.scheduler)
            results = await _run(h, work)
            _check(results, work)
            assert not losses and h.scheduler.is_drafter_available
            assert sum(usage.num_draft_tokens for _, _, usage in results[1:]) > 0
            await wait_until(lambda: not h.verifier.committed and not h.drafter.known, timeout_s=5)
            assert not h.scheduler.drafter_link.refused  # forgotten with the request

    asyncio.run(main())


def test_a_refusal_when_the_drafter_comes_back_leaves_only_that_request_undrafted() -> None:
    work = [(rid, prompt, {"max_tokens": 60, "ignore_eos": True}) for rid, prompt, _ in _workload(4)]

    async def main():
        async with _refusing_harness(mode="psd", max_num_seqs=4, delay_s=0.005) as h:
            h.drafter.is_failing = True  # down before anything is admitted: the refusal comes on re-add
            run = asyncio.create_task(_run(h, work))
            await wait_until(lambda: len(h.scheduler.running) == 5)
            assert not h.scheduler.is_drafter_available
            h.drafter.is_failing = False
            await wait_until(lambda: h.scheduler.is_drafter_available, timeout_s=5)
            assert BAD_ID in h.scheduler.running and BAD_ID not in h.drafter.known  # back before it ends
            calls = h.drafter.num_draft_calls
            _check(await run, work)
            assert h.drafter.num_draft_calls > calls

    asyncio.run(main())


class BrokenDrafter(FakeDrafter):
    """Answers every AddRequests with INTERNAL: the drafter itself is broken, not one request."""

    async def AddRequests(self, request, context):
        await context.abort(grpc.StatusCode.INTERNAL, "RuntimeError: engine thread died")


def test_an_internal_error_loses_the_drafter_instead_of_refusing_each_request() -> None:
    work = _workload(4)

    async def main():
        harness = Harness(mode="psd", max_num_seqs=4, delay_s=0.005)
        harness.drafter = BrokenDrafter(harness.verifier, accuracy=0.7, delay_s=harness.verifier.delay_s)
        async with harness as h:
            losses = _watch_losses(h.scheduler)
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, _, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            assert losses and not h.scheduler.is_drafter_available   # the ar fallback, gauge 0
            assert not h.scheduler.drafter_link.refused

    asyncio.run(main())
