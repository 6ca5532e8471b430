"""The coordinator's prompt-token budget per admission (``--max-num-batched-tokens``, like vLLM's
scheduler budget): pure helper, then the step loop against the in-process fake engines."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.admission import num_within_token_budget
from coordinator.config import NO_TOKEN_BUDGET, CoordinatorConfig
from coordinator_harness import Harness, _expected


def test_num_within_token_budget():
    lens = [100, 200, 5000, 10]
    assert num_within_token_budget(lens, NO_TOKEN_BUDGET) == 4
    assert num_within_token_budget(lens, 300) == 2 and num_within_token_budget(lens, 299) == 1
    assert num_within_token_budget([5000, 1], 300) == 1      # the head is admitted alone, however long
    assert num_within_token_budget([], 300) == 0
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        CoordinatorConfig(max_num_batched_tokens=-1)


def _run(mode: str, budget: int) -> tuple[list[int], list[bool]]:
    """Sizes of the verifier's AddRequests calls and, per request, whether its output equals the reference."""
    prompts = [[3 + i % 7, 5, 1 + i % 4] for i in range(9)] + [[2] * 10]   # the last is longer than the budget
    work = [(f"r{i}", p, {"max_tokens": 4 + i % 3}) for i, p in enumerate(prompts)]

    async def main():
        harness = Harness(mode=mode, max_num_seqs=5, num_speculative_tokens=2, delay_s=0.05,
                          max_num_batched_tokens=budget)
        sizes, original = [], harness.verifier.AddRequests

        async def recording(request, context):
            sizes.append(len(request.seqs))
            return await original(request, context)

        harness.verifier.AddRequests = recording   # before the servicer is registered
        async with harness as h:
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            return sizes, [tokens == _expected(p, s) for (_, p, s), (tokens, _, _) in zip(work, results)]
    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["ar", "sd", "psd"])
def test_admission_respects_the_prompt_token_budget(mode: str):
    sizes, is_equal = _run(mode, budget=7)          # two 3-token prompts fit, a third does not
    assert all(is_equal) and sum(sizes) == 10
    assert max(sizes) <= 2 and sizes.count(1) >= 1   # the 10-token prompt came alone
    unlimited, is_equal = _run(mode, budget=NO_TOKEN_BUDGET)
    assert all(is_equal) and max(unlimited) > 2      # the control: without a budget admissions are larger
