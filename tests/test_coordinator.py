"""Coordinator step loop against in-process fake engines served over real grpc.aio on loopback.

The fakes share a deterministic toy "model": the next token is ``toy_next(sequence)``. The fake
verifier accepts draft tokens greedily (accept while draft == toy_next, then one recovered or
bonus token), like a temperature-0 target. The fake drafter is right with probability
``accuracy`` (deterministic per request and position) and checks the DraftSeq catch-up protocol
against the verifier's committed sequences; the verifier checks it is given exactly the drafts
last made for each request at its current length. So ``ar``, ``sd`` and ``psd`` must all give the
token-by-token reference output.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import socket
import struct
import sys
import urllib.request

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.engines import decode_token_ids, encode_token_ids, join_prob_rows, split_prob_rows
from coordinator.finish import FinishParams, apply_finish
from coordinator.request import PendingDrafts
from coordinator.server import SERVICE_NAME, CoordinatorServicer, start
from minedraft.serving import ServerOptions, aio_channel, build_server, wait_for_serving
from minedraft.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, engine_pb2, engine_pb2_grpc

VOCAB, EOS, NUM_SLOTS = 40, 2, 32
BAD_TOKEN = 1000  # the fake verifier refuses prompts holding it


def toy_next(seq: list[int]) -> int:
    return (31 * seq[-1] + 17 * (seq[-2] if len(seq) > 1 else 5) + 7 * len(seq)) % VOCAB


def reference(prompt: list[int], params: FinishParams) -> list[int]:
    out: list[int] = []
    while True:
        emitted, reason = apply_finish([toy_next(prompt + out)], len(out), params, (EOS,))
        out += emitted
        if reason is not None:
            return out


async def wait_until(predicate, timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` every 5 ms; fail the test instead of hanging after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


def _unit(*parts) -> float:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") / 2**32


def _row_value(request_id: str) -> float:
    return float(sum(request_id.encode()) % 997)


class FakeVerifier(engine_pb2_grpc.VerifierServicer):
    def __init__(self, delay_s: float) -> None:
        self.committed: dict[str, list[int]] = {}
        self.delay_s, self.drafter, self.num_prob_rows, self.max_slots_used = delay_s, None, 0, 0
        self.num_dist_fetches, self.is_failing = 0, False

    async def AddRequests(self, request, context):
        if any(BAD_TOKEN in seq.prompt_token_ids for seq in request.seqs):  # all or nothing, like the real one
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt does not fit max_model_len")
        outputs = []
        for seq in request.seqs:
            assert seq.request_id not in self.committed and len(self.committed) < NUM_SLOTS
            self.committed[seq.request_id] = list(seq.prompt_token_ids) + [toy_next(list(seq.prompt_token_ids))]
            outputs.append(engine_pb2.SeqOutput(request_id=seq.request_id, token_ids=[self.committed[seq.request_id][-1]]))
        self.max_slots_used = max(self.max_slots_used, len(self.committed))
        return engine_pb2.AddRequestsResponse(outputs=outputs)

    async def Verify(self, request, context):
        await asyncio.sleep(self.delay_s)
        if self.is_failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier rank lost")
        rows = decode_token_ids(request.draft_token_ids) if request.draft_token_ids.shape else [[]] * len(request.request_ids)
        if request.has_draft_probs and request.data_plane == engine_pb2.DATA_PLANE_INLINE:
            self._check_probs(request)
        elif request.has_draft_probs:  # dist: probs come from the drafter, never through the coordinator
            assert request.data_plane == engine_pb2.DATA_PLANE_DIST and not request.HasField("draft_probs")
            self.num_dist_fetches += 1
        outputs = []
        for request_id, drafts in zip(request.request_ids, rows):
            seq = self.committed[request_id]
            if drafts:  # exactly the drafts last made for this request at its current length
                assert self.drafter.last_drafts[request_id] == (len(seq), drafts)
                assert self.drafter.last_step_ids[request_id] == request.draft_step_id
            out: list[int] = []
            for draft in drafts:
                out.append(toy_next(seq + out))
                if out[-1] != draft:
                    break
            else:
                out.append(toy_next(seq + out))
            seq += out
            accepted = len(out) - 1
            outputs.append(engine_pb2.SeqOutput(request_id=request_id, token_ids=out, num_accepted=accepted,
                                                logprobs=[-0.25] * len(out)))
        return engine_pb2.VerifyResponse(step_id=request.step_id, outputs=outputs, verify_ms=self.delay_s * 1e3)

    def _check_probs(self, request) -> None:
        b, k, vocab = request.draft_probs.shape
        values = struct.unpack(f"<{b * k * vocab}f", request.draft_probs.data)
        for i, request_id in enumerate(request.request_ids):
            assert set(values[i * k * vocab : (i + 1) * k * vocab]) == {_row_value(request_id)}
        self.num_prob_rows += b

    async def ReleaseRequests(self, request, context):
        released = [r for r in request.request_ids if self.committed.pop(r, None) is not None]
        return engine_pb2.ReleaseResponse(num_released=len(released))

    async def GetInfo(self, request, context):
        return engine_pb2.EngineInfo(model="toy", vocab_size=VOCAB, max_num_seqs=NUM_SLOTS,
                                     num_free_slots=NUM_SLOTS - len(self.committed), eos_token_ids=[EOS],
                                     request_ids=sorted(self.committed))


class FakeDrafter(engine_pb2_grpc.DrafterServicer):
    def __init__(self, verifier: FakeVerifier, accuracy: float, delay_s: float) -> None:
        self.verifier, self.accuracy, self.delay_s = verifier, accuracy, delay_s
        self.known: dict[str, list[int]] = {}
        self.sampling: dict[str, common_pb2.SamplingParams] = {}
        self.last_drafts: dict[str, tuple[int, list[int]]] = {}
        self.last_step_ids: dict[str, int] = {}
        self.step_ids_seen: set[int] = set()
        self.is_failing, self.num_draft_calls = False, 0
        verifier.drafter = self

    async def _check_up(self, context) -> None:
        if self.is_failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter down")

    async def AddRequests(self, request, context):
        await self._check_up(context)
        for seq in request.seqs:
            assert seq.request_id not in self.known
            self.known[seq.request_id] = list(seq.prompt_token_ids)
            self.sampling[seq.request_id] = seq.sampling
        return engine_pb2.AddRequestsResponse()

    async def Draft(self, request, context):
        await self._check_up(context)
        await asyncio.sleep(self.delay_s)
        self.num_draft_calls += 1
        assert request.step_id not in self.step_ids_seen, "drafter step ids must be unique"
        self.step_ids_seen.add(request.step_id)
        k, rows = request.num_speculative_tokens, []
        for seq in request.seqs:
            known = self.known[seq.request_id]
            assert 0 < seq.start_position <= len(known)
            known[seq.start_position :] = list(seq.token_ids)
            assert known == self.verifier.committed[seq.request_id], "catch-up protocol broken"
            drafts: list[int] = []
            for i in range(k):
                true = toy_next(known + drafts)
                is_right = _unit(seq.request_id, len(known), i) < self.accuracy
                drafts.append(true if is_right else (true + 1) % VOCAB)
            self.last_drafts[seq.request_id] = (len(known), drafts)
            self.last_step_ids[seq.request_id] = request.step_id
            rows.append(drafts)
        response = engine_pb2.DraftResponse(step_id=request.step_id, draft_token_ids=encode_token_ids(rows))
        is_sampled = any(self.sampling[s.request_id].temperature > 0 for s in request.seqs)
        if is_sampled and request.data_plane == engine_pb2.DATA_PLANE_DIST:
            response.has_draft_probs = True  # kept drafter-side for the verifier to fetch
        elif is_sampled:
            values = [_row_value(s.request_id) for s in request.seqs for _ in range(k * VOCAB)]
            response.draft_probs.CopyFrom(common_pb2.Tensor(shape=[len(rows), k, VOCAB], dtype="float32",
                                                            data=struct.pack(f"<{len(values)}f", *values)))
            response.has_draft_probs = True
        return response

    async def ReleaseRequests(self, request, context):
        await self._check_up(context)
        released = [r for r in request.request_ids if self.known.pop(r, None) is not None]
        return engine_pb2.ReleaseResponse(num_released=len(released))

    async def GetInfo(self, request, context):
        await self._check_up(context)
        return engine_pb2.EngineInfo(model="toy-draft", num_free_slots=NUM_SLOTS - len(self.known), eos_token_ids=[EOS],
                                     request_ids=sorted(self.known))


async def _serve(add, servicer, name):
    server, health, port = await build_server([name], ServerOptions(port=0))
    add(servicer, server)
    await server.start()
    await health.set_serving()
    return server, f"127.0.0.1:{port}"


class Harness:
    """Fake engines + coordinator (step loop and gRPC server) on loopback; checks invariants per step."""

    def __init__(self, accuracy: float = 0.7, delay_s: float = 0.002, **cfg) -> None:
        self.verifier = FakeVerifier(delay_s)
        self.drafter = FakeDrafter(self.verifier, accuracy, delay_s)
        self.cfg_kwargs = cfg
        self.num_checked_steps = 0

    async def __aenter__(self) -> Harness:
        self.servers = []
        for add, servicer, name in ((engine_pb2_grpc.add_VerifierServicer_to_server, self.verifier, "minedraft.v1.Verifier"),
                                    (engine_pb2_grpc.add_DrafterServicer_to_server, self.drafter, "minedraft.v1.Drafter")):
            self.servers.append(await _serve(add, servicer, name))
        cfg = CoordinatorConfig(verifier=self.servers[0][1], drafter=self.servers[1][1], engine_wait_s=10,
                                drafter_retry_s=0.05, **self.cfg_kwargs)
        self.servicer = CoordinatorServicer(cfg)
        self.scheduler, self.task = await start(cfg, self.servicer)
        self._wrap_step()
        server, address = await _serve(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, self.servicer, SERVICE_NAME)
        self.servers.append((server, address))
        self.channel = aio_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await self.channel.close()
        for server, _ in self.servers:
            await server.stop(None)
        await self.scheduler.engines.close()

    def _wrap_step(self) -> None:
        scheduler, original = self.scheduler, self.scheduler.step

        async def checked_step():
            self.check_invariants()
            stats = await original()
            self.check_invariants()
            self.num_checked_steps += 1
            return stats

        scheduler.step = checked_step

    def check_invariants(self) -> None:
        scheduler, batches = self.scheduler, self.scheduler.batches
        assert len(scheduler.running) <= scheduler.max_num_running
        assert len(self.verifier.committed) <= scheduler.max_num_running
        if scheduler.cfg.mode == "psd":
            batch0, batch1 = set(batches.batch(0)), set(batches.batch(1))
            assert not batch0 & batch1 and batch0 | batch1 == set(scheduler.running)
            assert batches.balance == len(batch1) - len(batch0)
            assert max(len(batch0), len(batch1)) <= scheduler.cfg.max_num_seqs

    async def generate(self, request_id: str, prompt: list[int], **sampling) -> tuple[list[int], str, object]:
        call = self.stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)))
        tokens: list[int] = []
        async for response in call:
            kind = response.WhichOneof("response")
            if kind == "chunk":
                tokens += response.chunk.token_ids
            elif kind == "finished":
                return tokens, response.finished.finish_reason, response.finished.usage
            else:
                return tokens, "error", response.error
        raise AssertionError("stream ended without finished/error")


def _workload(num_requests: int) -> list[tuple[str, list[int], dict]]:
    work = []
    for i in range(num_requests):
        sampling = {"max_tokens": 6 + (i * 7) % 23}
        if i % 4 == 1:
            sampling["stop_token_ids"] = [11]
        if i % 5 == 2:
            sampling["ignore_eos"] = True
        work.append((f"req-{i}", [3 + i % 9, 5 + (i * 3) % 13, 1 + i % 4], sampling))
    return work


def _expected(prompt: list[int], sampling: dict) -> list[int]:
    return reference(prompt, FinishParams(sampling["max_tokens"], tuple(sampling.get("stop_token_ids", ())),
                                          sampling.get("ignore_eos", False)))


@pytest.mark.parametrize("mode", ["ar", "sd", "psd"])
def test_greedy_output_equals_reference_in_every_mode(mode: str) -> None:
    max_num_seqs, work = 3, _workload(14)  # > 2m requests: batches fill, requests finish and get replaced

    async def main():
        async with Harness(mode=mode, max_num_seqs=max_num_seqs, num_speculative_tokens=3) as h:
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, usage) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
                assert reason in ("stop", "length") and usage.completion_tokens == len(tokens)
                assert usage.num_accepted_tokens <= usage.num_draft_tokens
            await asyncio.sleep(0.05)
            status = await h.stub.GetStatus(coordinator_pb2.StatusRequest())
            assert status.num_running == 0 and not h.verifier.committed and not h.drafter.known
            assert h.verifier.max_slots_used == (2 * max_num_seqs if mode == "psd" else max_num_seqs)
            assert h.num_checked_steps == status.num_steps > 0
            if mode == "ar":
                assert h.drafter.num_draft_calls == 0 and status.num_draft_tokens == 0
            else:
                assert status.num_accepted_tokens > 0 and status.num_draft_tokens > status.num_accepted_tokens
            assert (status.num_parallel_steps > status.num_steps // 2) if mode == "psd" else status.num_parallel_steps == 0
            metric = h.scheduler.metrics.registry.get_sample_value
            assert metric("minedraft:spec_decode_num_draft_tokens_total") == status.num_draft_tokens
            assert metric("minedraft:spec_decode_num_accepted_tokens_total") == status.num_accepted_tokens
            if mode != "ar":
                per_pos = [metric("minedraft:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(p)}) for p in range(3)]
                assert sum(per_pos) == status.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)

    asyncio.run(main())


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


@pytest.mark.parametrize("data_plane", ["inline", "dist"])
def test_sampled_draft_probs_follow_their_requests(data_plane: str) -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, data_plane=data_plane) as h:
            work = _workload(6)
            results = await asyncio.gather(*(h.generate(rid, p, temperature=0.8, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, _, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling)
            if data_plane == "inline":
                assert h.verifier.num_prob_rows > 0 and h.verifier.num_dist_fetches == 0
            else:
                assert h.verifier.num_dist_fetches > 0 and h.verifier.num_prob_rows == 0

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


@pytest.mark.parametrize(
    "bad",
    [{"mode": "fast"}, {"num_speculative_tokens": 0}, {"max_num_seqs": 0}, {"drafter": "nohost"},
     {"port": 70000}, {"metrics_port": -1}, {"data_plane": "nccl"}, {"max_queue_len": 0}, {"rpc_timeout_s": 0}, {"grace_s": -1}],
)
def test_config_validation_names_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        CoordinatorConfig(**bad)


def test_config_running_cap() -> None:
    assert CoordinatorConfig(mode="psd", max_num_seqs=4).max_num_running == 8
    assert CoordinatorConfig(mode="sd", max_num_seqs=4).max_num_running == 4
    assert not CoordinatorConfig(mode="ar").uses_drafter


def test_tensor_helpers_round_trip_and_reject_bad_shapes() -> None:
    rows = [[1, 2, 3], [40000, 0, 7]]
    assert decode_token_ids(encode_token_ids(rows)) == rows
    with pytest.raises(ValueError, match="rows"):
        encode_token_ids([[1], [1, 2]])
    with pytest.raises(ValueError, match="tensor"):
        decode_token_ids(common_pb2.Tensor(shape=[2, 2], dtype="int32", data=b"\0" * 12))
    probs = common_pb2.Tensor(shape=[2, 1, 3], dtype="float32", data=struct.pack("<6f", *range(6)))
    first, second = split_prob_rows(probs, 2)
    assert struct.unpack("<3f", second) == (3.0, 4.0, 5.0)
    drafts = [PendingDrafts(1, [5], second, "float32", 3, True), PendingDrafts(1, [6], first, "float32", 3, True)]
    joined = join_prob_rows(drafts)
    assert list(joined.shape) == [2, 1, 3] and struct.unpack("<6f", joined.data) == (3, 4, 5, 0, 1, 2)
    with pytest.raises(ValueError, match="tensor"):
        split_prob_rows(probs, 3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_main_serves_health_after_engines_and_drains_on_sigterm() -> None:
    """``python -m coordinator`` against the fake engines: health SERVING, a request, SIGTERM exit 0."""

    async def main():
        verifier = FakeVerifier(0.002)
        drafter = FakeDrafter(verifier, 0.7, 0.002)
        verifier.committed["one"], drafter.known["one"] = [1, 2], [1]  # left over by an earlier coordinator
        servers = [await _serve(engine_pb2_grpc.add_VerifierServicer_to_server, verifier, "minedraft.v1.Verifier"),
                   await _serve(engine_pb2_grpc.add_DrafterServicer_to_server, drafter, "minedraft.v1.Drafter")]
        port, metrics_port = _free_port(), _free_port()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator", "--mode", "psd", "--k", "2", "--max-num-seqs", "2",
            "--verifier", servers[0][1], "--drafter", servers[1][1], "--port", str(port), "--engine-wait", "30",
            "--metrics-port", str(metrics_port))
        try:
            await wait_for_serving(f"127.0.0.1:{port}", timeout_s=60, service=SERVICE_NAME)
            async with aio_channel(f"127.0.0.1:{port}") as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                call = stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
                    request_id="one", prompt_token_ids=[3, 4], sampling=common_pb2.SamplingParams(max_tokens=9)))
                tokens = [t async for r in call if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
                assert tokens == _expected([3, 4], {"max_tokens": 9})
                status = await stub.GetStatus(coordinator_pb2.StatusRequest())
                assert status.mode == "psd" and status.num_speculative_tokens == 2 and status.max_num_running == 4
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            body = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())).decode()
            assert f"minedraft:spec_decode_num_draft_tokens_total {float(status.num_draft_tokens)}" in body
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), timeout=30) == 0
        finally:
            if process.returncode is None:
                process.kill()
            for server, _ in servers:
                await server.stop(None)

    asyncio.run(main())


def test_requests_without_room_for_drafts_run_without_speculation_alone() -> None:
    """Draft window 12 tokens: a 14-token prompt never reaches the drafter, a short request stops
    speculating once committed + k - 1 > 12; outputs stay exact and the drafter stays in use."""
    from coordinator.context_window import ContextLimits

    async def main():
        async with Harness(mode="psd", max_num_seqs=2, num_speculative_tokens=3) as h:
            h.scheduler.limits = ContextLimits(verifier_max_model_len=0, drafter_max_model_len=12)
            work = [("long", list(range(3, 17)), {"max_tokens": 10}), ("short", [3, 4], {"max_tokens": 20}),
                    ("other", [5, 6], {"max_tokens": 6})]
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, _) in zip(work, results):
                assert reason in ("stop", "length") and tokens == _expected(prompt, sampling), rid
            assert "long" not in h.drafter.last_drafts
            num_known, drafts = h.drafter.last_drafts["short"]
            assert num_known + len(drafts) - 1 <= 12
            assert h.scheduler.is_drafter_available and h.scheduler.totals.num_draft_tokens > 0

    asyncio.run(main())
