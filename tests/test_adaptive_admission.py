"""Drafter-side admission (``coordinator.admission``): the coordinator admits at most what both
the verifier and the drafter hold; a drafter with fewer KV slots than 2m caps the running requests
(fake engines of ``test_coordinator``, the drafter refusing to exceed its slots)."""

from __future__ import annotations

import asyncio

import pytest
from test_coordinator import FakeDrafter, Harness, _expected, _workload

from coordinator.admission import NO_DRAFTER, EngineSlots
from coordinator.config import CoordinatorConfig
from minedraft.v1 import coordinator_pb2, engine_pb2

DRAFTER_SLOTS = 3


class SmallDrafter(FakeDrafter):
    """A drafter with ``DRAFTER_SLOTS`` KV slots: GetInfo reports them, AddRequests past them fails."""

    max_known = 0

    async def AddRequests(self, request, context):
        assert len(self.known) + len(request.seqs) <= DRAFTER_SLOTS, "drafter KV over capacity"
        response = await super().AddRequests(request, context)
        self.max_known = max(self.max_known, len(self.known))
        return response

    async def GetInfo(self, request, context):
        return engine_pb2.EngineInfo(model="toy-draft", max_num_seqs=DRAFTER_SLOTS,
                                     num_free_slots=DRAFTER_SLOTS - len(self.known), request_ids=sorted(self.known))


class SmallDrafterHarness(Harness):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drafter = SmallDrafter(self.verifier, 0.7, 0.002)


@pytest.mark.parametrize("mode", ["psd", "auto"])
def test_a_drafter_with_fewer_slots_caps_admission(mode: str) -> None:
    work = _workload(10)

    async def main():
        async with SmallDrafterHarness(mode=mode, max_num_seqs=4, num_speculative_tokens=3) as h:
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, _) in zip(work, results):
                assert reason in ("stop", "length") and tokens == _expected(prompt, sampling), rid
            status = await h.stub.GetStatus(coordinator_pb2.StatusRequest())
            assert (status.max_num_running, status.num_drafter_slots, status.num_verifier_slots) == (3, 3, 32)
            assert h.drafter.max_known == DRAFTER_SLOTS and h.verifier.max_slots_used <= DRAFTER_SLOTS
            assert h.scheduler.is_drafter_available and h.scheduler.totals.num_draft_tokens > 0

    asyncio.run(main())


def test_engine_slots_take_the_smaller_engine_when_it_is_used() -> None:
    psd, ar = CoordinatorConfig(mode="psd", max_num_seqs=8), CoordinatorConfig(mode="ar", max_num_seqs=8)
    assert EngineSlots(32, 12).max_num_running(psd) == 12 and EngineSlots(32, 12).limited_by(psd) == "drafter"
    assert EngineSlots(10, 32).limited_by(psd) == "verifier" and EngineSlots(32, 32).limited_by(psd) == "config"
    assert EngineSlots(32, NO_DRAFTER).max_num_running(ar) == 8
    with pytest.raises(ValueError, match="num_drafter_slots"):
        EngineSlots(32, NO_DRAFTER).max_num_running(psd)
    with pytest.raises(ValueError, match="num_verifier_slots"):
        EngineSlots(0, 4)
