"""A psd step keeps the coordinator's own work off its critical path (coordinator.stepping):
the verified batch is committed and streamed as soon as its Verify call returns, while the
other batch's Draft call still runs, and the call that took longer at the last parallel step
is sent first. Fake engines (tests/coordinator_harness.py) with one slow engine each time."""

from __future__ import annotations

import asyncio
import time

import pytest

import coordinator_harness
from coordinator_harness import Harness, _expected, _workload
from minedraft.v1 import common_pb2, coordinator_pb2

SLOW_S, FAST_S = 0.12, 0.005


def _slow(monkeypatch, cls, method: str, extra_s: float, ms_field: str, windows: list) -> None:
    """``cls.method`` sleeps ``extra_s`` more, reports its whole time in ``ms_field`` and files
    its (start, end) perf_counter window in ``windows``."""
    original = getattr(cls, method)

    async def slowed(self, request, context):
        start = time.perf_counter()
        await asyncio.sleep(extra_s)
        response = await original(self, request, context)
        setattr(response, ms_field, (time.perf_counter() - start) * 1e3)
        windows.append((start, time.perf_counter()))
        return response

    monkeypatch.setattr(cls, method, slowed)


async def _generate_timed(h: Harness, request_id: str, prompt: list[int], sampling: dict) -> tuple[list[int], list[float]]:
    """The request's tokens and the perf_counter time each chunk arrived."""
    call = h.stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)))
    tokens, arrivals = [], []
    async for response in call:
        if response.WhichOneof("response") == "chunk":
            tokens += response.chunk.token_ids
            arrivals.append(time.perf_counter())
    return tokens, arrivals


def _call_order(h: Harness) -> list[tuple[int, str]]:
    """(step id, "draft" / "verify") in the order each step sends the engine calls it runs side by
    side (``StepLoop._verify_while_drafting``; an sd part's Draft call before them is left out)."""
    order, scheduler, engines, inside = [], h.scheduler, h.scheduler.engines, [False]
    for name in ("draft", "verify"):
        original = getattr(engines, name)

        def entered(*args, _name=name, _original=original, **kwargs):
            if inside[0]:
                order.append((scheduler.step_id, _name))
            return _original(*args, **kwargs)

        setattr(engines, name, entered)
    side_by_side = scheduler._verify_while_drafting

    async def marked(*args, **kwargs):
        inside[0] = True
        try:
            return await side_by_side(*args, **kwargs)
        finally:
            inside[0] = False

    scheduler._verify_while_drafting = marked
    return order


def _first_calls_of_parallel_steps(order: list[tuple[int, str]]) -> list[str]:
    """The first call of each step that sent a Draft and a Verify call side by side, the first
    such step left out (no parallel step came before it)."""
    steps: dict[int, list[str]] = {}
    for step_id, name in order:
        steps.setdefault(step_id, []).append(name)
    both = [names for names in steps.values() if {"draft", "verify"} <= set(names)]
    return [names[0] for names in both[1:]]


@pytest.mark.parametrize("slow", ["drafter", "verifier"])
def test_the_verified_batch_streams_during_the_draft_call_and_the_longer_call_goes_first(monkeypatch, slow):
    windows: list[tuple[float, float]] = []
    if slow == "drafter":
        _slow(monkeypatch, coordinator_harness.FakeDrafter, "Draft", SLOW_S, "draft_ms", windows)
    else:
        _slow(monkeypatch, coordinator_harness.FakeVerifier, "Verify", SLOW_S, "verify_ms", [])
        _slow(monkeypatch, coordinator_harness.FakeDrafter, "Draft", 0.0, "draft_ms", windows)
    work = _workload(8)

    async def main():
        async with Harness(mode="psd", max_num_seqs=2, num_speculative_tokens=3, delay_s=FAST_S) as h:
            order = _call_order(h)
            results = await asyncio.gather(*(_generate_timed(h, rid, p, s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            return order, [t for _, arrivals in results for t in arrivals]

    order, arrivals = asyncio.run(main())
    firsts = _first_calls_of_parallel_steps(order)
    assert len(firsts) >= 5
    if slow == "drafter":
        # chunks of the verified batch reach the client while the other batch is still being drafted,
        # long before its Draft call ends (committed after both calls, they came after its end)
        margin = SLOW_S / 2
        inside = [t for t in arrivals if any(start < t < end - margin for start, end in windows)]
        assert len(inside) >= 5, (len(inside), len(arrivals))
        assert firsts.count("draft") == len(firsts), firsts
    else:
        assert firsts.count("verify") == len(firsts), firsts


def test_an_unexpected_draft_ahead_failure_is_logged_and_the_batch_drafted_at_its_verify_step(caplog):
    work = _workload(6)

    async def main():
        async with Harness(mode="psd", max_num_seqs=2, num_speculative_tokens=3) as h:
            scheduler, original, failures = h.scheduler, h.scheduler._draft, []

            async def failing_once(requests, times, batch, mode):
                if not failures and scheduler.batches.draft_batch() == [r.request_id for r in requests]:
                    failures.append(scheduler.step_id)
                    raise RuntimeError("draft-ahead bug")
                return await original(requests, times, batch, mode)

            scheduler._draft = failing_once
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling) and reason in ("stop", "length"), rid
            return failures

    with caplog.at_level("ERROR", logger="coordinator.stepping"):
        failures = asyncio.run(main())
    assert len(failures) == 1
    assert f"step {failures[0]}: the draft-ahead call failed" in caplog.text and "draft-ahead bug" in caplog.text
