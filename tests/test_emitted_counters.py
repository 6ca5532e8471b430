"""Issue 25.2: every counter counts only emitted tokens, also when a stop string cuts a block.

The gateway's usage (``gateway.output.RequestOutput``), the coordinator's Prometheus counters and
its GetStatus totals (``coordinator.emitted``, on the fake engines of tests/coordinator_harness.py)
after a stop-string cut inside an accepted block, while the request runs and after the coordinator
finished it itself; plus ``cut_blocks``.
"""
from __future__ import annotations

import asyncio

from minedraft.v1 import common_pb2, coordinator_pb2

from coordinator.emitted import Block, EmittedCounter, cut_blocks
from coordinator.stats import StepTotals
from coordinator_harness import Harness, wait_until
from gateway.output import RequestOutput


def test_gateway_usage_counts_only_the_kept_part_of_a_cut_block(tokenizer):
    """The issue's case: text "1", 2 completion tokens, but 4 accepted counted before the fix."""
    output = RequestOutput(tokenizer, [1, 2], (":",), include_stop_str_in_output=False)
    one, colon, rest = tokenizer.encode("1", add_special_tokens=False), tokenizer.encode(":", add_special_tokens=False), \
        tokenizer.encode(" I will", add_special_tokens=False)
    block = colon + rest + one + one                     # 4 accepted drafts + the bonus token
    output.on_chunk(coordinator_pb2.TokenChunk(token_ids=one, num_draft_tokens=0, num_accepted_tokens=0))
    output.on_chunk(coordinator_pb2.TokenChunk(token_ids=block[:5], num_draft_tokens=4, num_accepted_tokens=4))
    output.on_finish()
    complete = output.complete("abort", None)
    assert complete.text == "1" and complete.finish_reason == "stop"
    assert complete.usage.completion_tokens == 2
    assert complete.usage.num_accepted_tokens == 1 and complete.usage.num_drafts == 1   # mean length 2.0
    assert complete.usage.num_draft_tokens == 4


def test_cut_blocks_keeps_the_accepted_tokens_first():
    blocks = [Block(0, 0, 1), Block(3, 3, 4), Block(3, 1, 2), Block(3, 0, 1)]
    assert cut_blocks(blocks, 8) == blocks
    assert cut_blocks(blocks, 3) == [Block(0, 0, 1), Block(3, 2, 2)]
    assert cut_blocks(blocks, 5) == [Block(0, 0, 1), Block(3, 3, 4)]
    assert cut_blocks(blocks, 6) == [Block(0, 0, 1), Block(3, 3, 4), Block(3, 1, 1)]


class _Metrics:
    def __init__(self):
        self.blocks = []

    def observe_block(self, block):
        self.blocks.append(block)


def test_unsettled_requests_are_counted_in_full_when_too_many_wait():
    class Request:
        def __init__(self, request_id):
            self.request_id, self.has_stop_strings, self.blocks = request_id, True, [Block(0, 0, 1)]

    metrics = _Metrics()
    counter = EmittedCounter(metrics, StepTotals(), max_unsettled=2)
    for i in range(3):
        counter.on_retire(Request(f"r{i}"))
    assert counter.num_unsettled == 2 and len(metrics.blocks) == 1     # r0: its gateway never settled
    assert counter.settle("r1", 0) and not counter.settle("r1", 0) and len(metrics.blocks) == 1


def _counters(h: Harness) -> dict[str, float]:
    metric = h.scheduler.metrics.registry.get_sample_value
    names = {"generation": "minedraft:generation_tokens_total", "drafts": "minedraft:spec_decode_num_drafts_total",
             "draft_tokens": "minedraft:spec_decode_num_draft_tokens_total",
             "accepted": "minedraft:spec_decode_num_accepted_tokens_total"}
    counters = {key: metric(name) or 0.0 for key, name in names.items()}
    counters["per_pos"] = [metric("minedraft:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(p)}) or 0.0
                           for p in range(3)]
    return counters


def _expected(blocks: list[Block]) -> dict[str, float]:
    drafted = [b for b in blocks if b.num_draft_tokens]
    return {"generation": sum(b.num_tokens for b in blocks), "drafts": len(drafted),
            "draft_tokens": sum(b.num_draft_tokens for b in drafted),
            "accepted": sum(b.num_accepted_tokens for b in drafted),
            "per_pos": [sum(1 for b in drafted if b.num_accepted_tokens > p) for p in range(3)]}


async def _stream_until_cut(h: Harness, request_id: str, read_to_end: bool) -> tuple[list[Block], int]:
    """Stream a request with stop strings; the "stop string" ends inside the first block of >= 2
    accepted drafts, after its first accepted token. Returns (blocks streamed, cut)."""
    call = h.stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
        request_id=request_id, prompt_token_ids=[3, 5, 1], has_stop_strings=True,
        sampling=common_pb2.SamplingParams(max_tokens=40, ignore_eos=True)))
    blocks, cut, num_tokens = [], None, 0
    async for response in call:
        if response.WhichOneof("response") != "chunk":
            break
        chunk = response.chunk
        blocks.append(Block(chunk.num_draft_tokens, chunk.num_accepted_tokens, len(chunk.token_ids)))
        if cut is None and chunk.num_accepted_tokens >= 2:
            cut = num_tokens + 1
            if not read_to_end:
                break
        num_tokens += len(chunk.token_ids)
    call.cancel()
    assert cut is not None, blocks
    return blocks, cut


def _check_cut(read_to_end: bool) -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, num_speculative_tokens=3, accuracy=0.9, delay_s=0.01) as h:
            blocks, cut = await _stream_until_cut(h, "stopped", read_to_end)
            await wait_until(lambda: not h.scheduler.running or read_to_end)
            await h.stub.Abort(common_pb2.AbortRequest(request_id="stopped", num_output_tokens=cut))
            await wait_until(lambda: not h.scheduler.running and h.scheduler.emitted.num_unsettled == 0)
            status = await h.stub.GetStatus(coordinator_pb2.StatusRequest())
            expected = _expected(cut_blocks(blocks, cut))
            assert _counters(h) == expected
            assert status.num_accepted_tokens == expected["accepted"]
            assert status.num_draft_tokens == expected["draft_tokens"]
            assert expected["generation"] == cut
            assert status.num_emitted_tokens == cut - 1  # steps' tokens: the first came with the prefill

    asyncio.run(main())


def test_coordinator_counters_stop_at_a_cut_while_the_request_runs():
    _check_cut(read_to_end=False)


def test_coordinator_counters_stop_at_a_cut_after_the_coordinator_finished_it():
    _check_cut(read_to_end=True)


def test_requests_without_stop_strings_are_counted_at_once_and_settled_ones_in_full():
    async def main():
        async with Harness(mode="sd", max_num_seqs=2, num_speculative_tokens=3, accuracy=0.9) as h:
            tokens, _, usage = await h.generate("plain", [3, 5, 1], max_tokens=12, ignore_eos=True)
            assert _counters(h)["generation"] == len(tokens) == 12
            assert _counters(h)["accepted"] == usage.num_accepted_tokens
            call = h.stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
                request_id="held", prompt_token_ids=[3, 5, 1], has_stop_strings=True,
                sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True)))
            async for response in call:
                if response.WhichOneof("response") == "finished":
                    held = response.finished.usage
            assert _counters(h)["generation"] == 12      # held until the gateway settles it
            await h.stub.Abort(common_pb2.AbortRequest(request_id="held", num_output_tokens=12))
            assert _counters(h)["generation"] == 24
            assert _counters(h)["accepted"] == usage.num_accepted_tokens + held.num_accepted_tokens

    asyncio.run(main())
