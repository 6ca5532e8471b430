"""Coordinator faults against the fake engines (tests/coordinator_harness.py): aborts mid-stream,
a drafter outage (fallback to ar, then recovery), a failing verifier, a refused prompt, invalid
and excess requests.
"""

from __future__ import annotations

import asyncio

import grpc

from coordinator_harness import BAD_TOKEN, FakeVerifier, Harness, _expected, _workload, toy_next, wait_until
from minedraft.v1 import common_pb2, coordinator_pb2, engine_pb2


def test_abort_mid_stream_frees_slots_in_both_engines() -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, delay_s=0.01) as h:
            call = h.stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
                request_id="cancelled", prompt_token_ids=[4, 5], sampling=common_pb2.SamplingParams(max_tokens=500, ignore_eos=True)))
            aborted = asyncio.create_task(h.generate("aborted", [6, 7], max_tokens=500, ignore_eos=True))
            others = [asyncio.create_task(h.generate(rid, p, **s)) for rid, p, s in _workload(5)]
            num_chunks = 0
            async for _ in call:
                num_chunks += 1
                if num_chunks == 3:
                    call.cancel()
                    break
            assert (await h.stub.Abort(common_pb2.AbortRequest(request_id="aborted"))).found
            tokens, reason, usage = await aborted
            assert reason == "abort" and tokens == _expected([6, 7], {"max_tokens": 500, "ignore_eos": True})[: len(tokens)]
            assert not (await h.stub.Abort(common_pb2.AbortRequest(request_id="never-seen"))).found
            for task, (rid, prompt, sampling) in zip(others, _workload(5)):
                assert (await task)[0] == _expected(prompt, sampling)
            await wait_until(lambda: not h.verifier.committed and not h.drafter.known, timeout_s=5)
            assert (await h.stub.GetStatus(coordinator_pb2.StatusRequest())).num_running == 0

    asyncio.run(main())


def test_drafter_outage_falls_back_to_ar_and_recovers() -> None:
    work = _workload(8)

    async def main():
        async with Harness(mode="psd", max_num_seqs=2, delay_s=0.005) as h:
            tasks = [asyncio.create_task(h.generate(rid, p, max_tokens=60, ignore_eos=True)) for rid, p, _ in work]
            await wait_until(lambda: h.scheduler.totals.num_steps >= 4)
            h.drafter.is_failing = True
            await wait_until(lambda: not h.scheduler.is_drafter_available)
            status = await h.stub.GetStatus(coordinator_pb2.StatusRequest())
            assert status.effective_mode == "ar" and not status.is_drafter_available
            steps_in_ar = h.scheduler.totals.num_steps
            await wait_until(lambda: h.scheduler.totals.num_steps >= steps_in_ar + 3)
            h.drafter.known.clear()  # the drafter restarted and lost its state
            calls_before = h.drafter.num_draft_calls
            h.drafter.is_failing = False
            for task, (rid, prompt, _) in zip(tasks, work):
                assert (await task)[0] == _expected(prompt, {"max_tokens": 60, "ignore_eos": True}), rid
            assert h.scheduler.is_drafter_available and h.drafter.num_draft_calls > calls_before

    asyncio.run(main())


def test_verifier_failure_fails_running_requests_and_loop_keeps_serving() -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, delay_s=0.005) as h:
            tasks = [asyncio.create_task(h.generate(f"r{i}", [3, i], max_tokens=300, ignore_eos=True)) for i in range(3)]
            await wait_until(lambda: h.scheduler.totals.num_steps >= 3)
            h.verifier.is_failing = True
            for tokens, reason, error in await asyncio.gather(*tasks):
                assert reason == "error" and error.code == grpc.StatusCode.UNAVAILABLE.value[0] and tokens
            h.verifier.is_failing = False
            tokens, reason, _ = await h.generate("after", [8, 9], max_tokens=12)
            assert tokens == _expected([8, 9], {"max_tokens": 12})
            await asyncio.sleep(0.05)
            assert not h.verifier.committed and not h.drafter.known

    asyncio.run(main())


def test_a_refused_prompt_fails_alone() -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=3) as h:
            work = _workload(6)
            tasks = [h.generate(rid, p, **s) for rid, p, s in work] + [h.generate("bad", [4, BAD_TOKEN], max_tokens=5)]
            *results, bad = await asyncio.gather(*tasks)
            assert bad[1] == "error" and bad[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            for (rid, prompt, sampling), (tokens, reason, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
            await wait_until(lambda: not h.verifier.committed and not h.drafter.known, timeout_s=5)
            seqs = [engine_pb2.SeqInit(request_id=rid, prompt_token_ids=prompt) for rid, prompt in
                    (("ok-1", [3, 4]), ("bad-1", [BAD_TOKEN]), ("ok-2", [5]))]
            outcomes = await h.scheduler.engines.prefill_verifier(seqs)  # the batch is retried one by one
            assert outcomes["bad-1"].code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [outcomes[r].token_ids[0] for r in ("ok-1", "ok-2")] == [toy_next([3, 4]), toy_next([5])]

    asyncio.run(main())


def test_a_first_output_of_more_than_one_token_fails_that_request_alone(monkeypatch) -> None:
    """AddRequests answers each new request with its first token only; a verifier that sends more
    (tokens its decode calls would send again) fails that request, not the others."""
    original = FakeVerifier.AddRequests

    async def add(self, request, context):
        response = await original(self, request, context)
        for out in response.outputs:
            if out.request_id == "two-firsts":
                out.token_ids.append(7)
        return response

    monkeypatch.setattr(FakeVerifier, "AddRequests", add)

    async def main():
        async with Harness(mode="ar", max_num_seqs=3) as h:
            work = _workload(3)
            tasks = [h.generate(rid, p, **s) for rid, p, s in work] + [h.generate("two-firsts", [4, 5], max_tokens=5)]
            *results, bad = await asyncio.gather(*tasks)
            assert bad[1] == "error" and bad[2].code == grpc.StatusCode.INTERNAL.value[0]
            assert "2 first tokens, not 1" in bad[2].message
            for (rid, prompt, sampling), (tokens, _, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid

    asyncio.run(main())


def test_invalid_and_excess_requests_get_errors() -> None:
    async def main():
        async with Harness(mode="sd", max_num_seqs=1, max_queue_len=1, delay_s=0.02) as h:
            _, reason, error = await h.generate("bad", [1, 2], max_tokens=0)
            assert reason == "error" and error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            _, reason, error = await h.generate("empty", [], max_tokens=3)
            assert reason == "error" and "prompt_token_ids" in error.message
            _, reason, error = await h.generate("neg-stop", [1], max_tokens=3, stop_token_ids=[-4])
            assert reason == "error" and "stop_token_ids" in error.message
            running = asyncio.create_task(h.generate("running", [3, 4], max_tokens=40, ignore_eos=True))
            await wait_until(lambda: bool(h.scheduler.running))
            queued = asyncio.create_task(h.generate("queued", [3, 5], max_tokens=4))
            await wait_until(lambda: bool(h.scheduler.waiting))
            _, reason, error = await h.generate("excess", [3, 6], max_tokens=4)
            assert reason == "error" and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            _, reason, error = await h.generate("queued", [3, 5], max_tokens=4)
            assert reason == "error" and error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
            assert [(await task)[1] for task in (running, queued)] == ["length", "length"]

    asyncio.run(main())


def test_a_stale_abort_of_a_reused_id_leaves_the_new_request_alone() -> None:
    """A stream that cleans up after itself aborts its own request only (``Scheduler.abort(id,
    request)``), not a newer request that reuses the id after an Abort freed it."""
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, delay_s=0.01) as h:
            # long enough to be still running when the abort lands, also on a loaded host
            old = asyncio.create_task(h.generate("dup", [4, 5], max_tokens=50000, ignore_eos=True))
            await wait_until(lambda: "dup" in h.scheduler.running, timeout_s=5)
            old_state = h.scheduler.running["dup"]
            assert (await h.stub.Abort(common_pb2.AbortRequest(request_id="dup"))).found
            assert (await old)[1] == "abort"
            new = asyncio.create_task(h.generate("dup", [6, 7], max_tokens=24, ignore_eos=True))
            await wait_until(lambda: "dup" in h.scheduler.running or "dup" in h.scheduler.waiting, timeout_s=5)
            assert h.scheduler.abort("dup", old_state) is False  # the old stream's late clean-up
            tokens, reason, _ = await new
            assert reason == "length" and tokens == _expected([6, 7], {"max_tokens": 24, "ignore_eos": True})

    asyncio.run(main())


def test_an_id_reused_while_its_release_is_in_flight_waits_for_it(monkeypatch) -> None:
    """Abort + reuse landing while the step loop awaits a KV release: the new request is admitted
    only after the old one's release ran (the engines refuse an id that is still active). The
    release of "short" is held until the abort and the reuse have landed (no timing race)."""
    release_started, proceed = asyncio.Event(), asyncio.Event()
    release = FakeVerifier.ReleaseRequests

    async def held_release(self, request, context):
        if "short" in request.request_ids:
            release_started.set()
            await proceed.wait()  # a busy engine host
        return await release(self, request, context)

    monkeypatch.setattr(FakeVerifier, "ReleaseRequests", held_release)

    async def main():
        async with Harness(mode="psd", max_num_seqs=2, delay_s=0.01) as h:
            old = asyncio.create_task(h.generate("dup", [4, 5], max_tokens=500, ignore_eos=True))
            await wait_until(lambda: "dup" in h.scheduler.running, timeout_s=5)
            await h.generate("short", [6, 7], max_tokens=2, ignore_eos=True)
            await release_started.wait()  # the loop is in _sync, releasing "short"
            assert (await h.stub.Abort(common_pb2.AbortRequest(request_id="dup"))).found
            assert (await old)[1] == "abort"
            reuse = asyncio.create_task(h.generate("dup", [6, 7], max_tokens=8, ignore_eos=True))
            await wait_until(lambda: "dup" in h.scheduler.waiting, timeout_s=5)   # queued, its release pending
            proceed.set()
            tokens, reason, _ = await reuse
            assert reason == "length" and tokens == _expected([6, 7], {"max_tokens": 8, "ignore_eos": True})
            await wait_until(lambda: not h.verifier.committed, timeout_s=5)

    asyncio.run(main())


def test_a_cancelled_stream_cleans_up_its_own_request_not_a_reuse_of_its_id() -> None:
    """Generate's clean-up after a cancel (no finish read) aborts its own request only."""
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, delay_s=0.01) as h:
            old = h.servicer.Generate(coordinator_pb2.CoordinatorGenerateRequest(
                request_id="dup", prompt_token_ids=[4, 5],
                sampling=common_pb2.SamplingParams(max_tokens=500, ignore_eos=True)), None)
            assert (await old.__anext__()).WhichOneof("response") == "chunk"
            assert h.scheduler.abort("dup")  # as the Abort RPC; the old stream has not read its finish
            new = asyncio.create_task(h.generate("dup", [6, 7], max_tokens=24, ignore_eos=True))
            await wait_until(lambda: "dup" in h.scheduler.running, timeout_s=5)
            await old.aclose()  # the client went away: the stream's finally runs
            tokens, reason, _ = await new
            assert reason == "length" and tokens == _expected([6, 7], {"max_tokens": 24, "ignore_eos": True})

    asyncio.run(main())
