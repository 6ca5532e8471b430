"""Drafter fallback while the coordinator is idle (coordinator.fallback, coordinator.scheduler):
a lost drafter is probed without requests, so ``drafter_available`` comes back on its own, and the
idle loop sleeps between probes (no busy loop)."""

from __future__ import annotations

import asyncio

from coordinator_harness import Harness, wait_until
from minedraft.v1 import coordinator_pb2

RETRY_S = 0.05  # Harness's drafter_retry_s


def _count_syncs(scheduler) -> list[int]:
    """Count the step loop's passes (each starts with ``_sync``)."""
    calls, original = [0], scheduler._sync

    async def counted():
        calls[0] += 1
        await original()

    scheduler._sync = counted
    return calls


def test_a_drafter_back_while_idle_is_noticed_without_a_request() -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2) as h:
            h.drafter.is_failing = True
            tokens, reason, _ = await h.generate("in-ar", [3, 4], max_tokens=8)  # loses the drafter
            assert reason == "length" and not h.scheduler.is_drafter_available
            gauge = h.scheduler.metrics.registry.get_sample_value
            assert gauge("minedraft:drafter_available") == 0
            passes = _count_syncs(h.scheduler)
            await asyncio.sleep(10 * RETRY_S)  # idle, drafter still down: one pass per probe
            assert 3 <= passes[0] <= 15, passes
            h.drafter.is_failing = False
            await wait_until(lambda: h.scheduler.is_drafter_available, timeout_s=5)
            assert gauge("minedraft:drafter_available") == 1
            assert (await h.stub.GetStatus(coordinator_pb2.StatusRequest())).is_drafter_available
            before = passes[0]
            await asyncio.sleep(5 * RETRY_S)  # idle with the drafter up: the loop sleeps
            assert passes[0] == before

    asyncio.run(main())


def test_a_drafter_that_dies_while_idle_reads_as_unavailable_without_a_request() -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2) as h:
            link = h.scheduler.drafter_link
            link.idle_check_s, link._next_check = 2 * RETRY_S, 0.0   # instead of the 5 s default
            tokens, reason, _ = await h.generate("speculating", [3, 4], max_tokens=8)
            assert reason == "length" and h.scheduler.is_drafter_available
            gauge = h.scheduler.metrics.registry.get_sample_value
            passes = _count_syncs(h.scheduler)
            await asyncio.sleep(10 * RETRY_S)   # idle, drafter up: one pass per idle check, no busy loop
            assert 2 <= passes[0] <= 8, passes
            h.drafter.is_failing = True          # dies between requests
            await wait_until(lambda: not h.scheduler.is_drafter_available, timeout_s=5)
            assert gauge("minedraft:drafter_available") == 0
            h.drafter.is_failing = False         # and comes back: the probe notices it
            await wait_until(lambda: h.scheduler.is_drafter_available, timeout_s=5)
            assert gauge("minedraft:drafter_available") == 1

    asyncio.run(main())
