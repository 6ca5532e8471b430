"""``n`` > 1 through the real coordinator (issue 25): an in-process ``GatewayServicer`` in front of
the coordinator of tests/coordinator_harness.py (its step loop, queue and admission over fake
engines whose toy model is greedy).

Checked: greedy choices equal n = 1 and the toy reference in ``psd``; each choice is a request of
its own in the coordinator's queue and admission (a request whose children overflow the queue
fails with RESOURCE_EXHAUSTED and its admitted children are aborted); closing the stream (a client
cancel) aborts every child and frees their KV slots.
"""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from coordinator.finish import FinishParams
from coordinator_harness import Harness, reference, wait_until
from gateway.config import GatewayConfig
from gateway.server import GatewayServicer
from gateway.tokenizer import PromptTokenizer
from minedraft.client import build_request

PROMPT = [3, 5, 1]


async def _servicer(h: Harness, tokenizer_dir: str) -> GatewayServicer:
    cfg = GatewayConfig(tokenizer=tokenizer_dir, coordinator=h.servers[-1][1], max_model_len=256, http_port=0)
    return GatewayServicer(cfg, PromptTokenizer(tokenizer_dir))


async def _choices(servicer: GatewayServicer, **kwargs) -> dict[int, object]:
    """index -> complete, or raises AssertionError with the stream's error."""
    completes = {}
    async for response in servicer.run(servicer.prepare(build_request(prompt_token_ids=PROMPT, **kwargs))):
        kind = response.WhichOneof("response")
        assert kind != "error", response.error
        if kind == "complete":
            completes[response.complete.index] = response.complete
    return completes


def test_greedy_choices_through_the_coordinator_equal_n1_and_the_reference(tokenizer_dir):
    expected = reference(PROMPT, FinishParams(12, (), True))

    async def main():
        async with Harness(mode="psd", max_num_seqs=2, num_speculative_tokens=3) as h:
            servicer = await _servicer(h, tokenizer_dir)
            one = await _choices(servicer, max_tokens=12, ignore_eos=True, request_id="one")
            three = await _choices(servicer, max_tokens=12, ignore_eos=True, request_id="three", n=3)
            assert list(one[0].output_token_ids) == expected
            assert sorted(three) == [0, 1, 2]
            assert all(list(c.output_token_ids) == expected for c in three.values())
            assert all(c.usage.num_draft_tokens > 0 for c in three.values())  # speculated like any request
            await servicer.close()

    asyncio.run(main())


def test_children_count_in_the_coordinators_queue_and_admission(tokenizer_dir):
    async def main():
        async with Harness(mode="sd", max_num_seqs=1, max_queue_len=3, delay_s=0.02) as h:
            servicer = await _servicer(h, tokenizer_dir)
            first = asyncio.create_task(_choices(servicer, max_tokens=30, ignore_eos=True, n=3, request_id="big"))
            await wait_until(lambda: len(h.scheduler.running) == 1 and len(h.scheduler.waiting) == 2)
            responses = [r async for r in servicer.run(servicer.prepare(
                build_request(prompt_token_ids=PROMPT, max_tokens=4, n=2, request_id="overflow")))]
            assert responses[-1].WhichOneof("response") == "error"
            assert responses[-1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            await wait_until(lambda: not any(i.startswith("overflow") for i in h.scheduler.waiting))
            completes = await first
            expected = reference(PROMPT, FinishParams(30, (), True))
            assert [list(completes[i].output_token_ids) for i in range(3)] == [expected] * 3
            await servicer.close()

    asyncio.run(main())


def test_closing_the_stream_aborts_every_child_and_frees_their_slots(tokenizer_dir):
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, delay_s=0.02) as h:
            servicer = await _servicer(h, tokenizer_dir)
            stream = servicer.run(servicer.prepare(build_request(
                prompt_token_ids=PROMPT, max_tokens=200, ignore_eos=True, n=3, request_id="cancel")))
            async with contextlib.aclosing(stream):
                async for response in stream:
                    if response.WhichOneof("response") == "chunk" and response.chunk.token_ids:
                        break
            assert len(h.scheduler.running) + len(h.scheduler.waiting) <= 3
            await wait_until(lambda: not h.scheduler.running and not h.scheduler.waiting)
            await wait_until(lambda: not h.verifier.committed and not h.drafter.known)  # KV released
            assert await _choices(servicer, max_tokens=2, n=3, request_id="cancel")  # the ids are free again
            await servicer.close()

    asyncio.run(main())
