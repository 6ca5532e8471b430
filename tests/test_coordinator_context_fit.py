"""The coordinator refuses a request that cannot fit the verifier's context window up front
(INVALID_ARGUMENT naming ``sampling.max_tokens``, the gateway's rule: prompt + max_tokens <=
max_model_len) instead of running it until the verifier fails it with a CapacityError
(RESOURCE_EXHAUSTED after hundreds of streamed tokens; found by breaking a running stack)."""

from __future__ import annotations

import asyncio

import grpc

from coordinator.context_window import ContextLimits
from coordinator_harness import Harness, _expected, wait_until

MAX_MODEL_LEN = 16


def test_request_past_the_verifier_window_is_refused_and_one_that_fits_runs() -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, num_speculative_tokens=3) as h:
            h.scheduler.limits = ContextLimits(verifier_max_model_len=MAX_MODEL_LEN, drafter_max_model_len=MAX_MODEL_LEN)
            for prompt, max_tokens in (([3, 4, 5, 6], MAX_MODEL_LEN - 3), ([3] * MAX_MODEL_LEN, 1)):
                tokens, reason, error = await h.generate("too-long", prompt, max_tokens=max_tokens, ignore_eos=True)
                assert (tokens, reason) == ([], "error"), (prompt, max_tokens)
                assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert error.message.startswith("sampling.max_tokens:") and str(MAX_MODEL_LEN) in error.message
            tokens, reason, _ = await h.generate("fits", [3, 4, 5, 6], max_tokens=MAX_MODEL_LEN - 4, ignore_eos=True)
            assert reason == "length" and tokens == _expected([3, 4, 5, 6], {"max_tokens": MAX_MODEL_LEN - 4,
                                                                             "ignore_eos": True})
            await wait_until(lambda: not h.verifier.committed and not h.drafter.known, timeout_s=5)  # released

    asyncio.run(main())
