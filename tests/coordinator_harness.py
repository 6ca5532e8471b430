"""Fake engines and a coordinator harness for the coordinator step-loop tests.

In-process fake engines served over real grpc.aio on loopback (used by test_coordinator*.py,
test_adaptive*.py, test_auto_mode.py, test_balancer.py).

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
import struct
import time

import grpc

from coordinator.config import CoordinatorConfig
from coordinator.engines import decode_token_ids, encode_token_ids
from coordinator.finish import FinishParams, apply_finish
from coordinator.server import SERVICE_NAME, CoordinatorServicer, start
from minedraft.serving import ServerOptions, aio_channel, build_server
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
        self.decode_steps_seen: list[int] = []   # VerifyRequest.num_decode_steps > 1 seen
        self.stream_intervals_seen: list[int] = []   # VerifyRequest.stream_interval of each VerifyStream call
        self.stream_interval_ms_seen: list[int] = []   # ... and its stream_interval_ms
        self.max_decode_steps_seen: list[tuple] = []  # (request ids, max_decode_steps) of each multi-step call
        self.call_ends_s: list[float] = []       # perf_counter at the end of each streamed call
        # as the vLLM verifier: requests added while a multi-step call runs decode in it too
        self.joins_decode, self._joined_ids = False, None
        self.add_delay_s, self.adds_in_flight, self.max_adds_in_flight = 0.0, 0, 0   # AddRequests' prefill time
        self.streams_joined = True  # False: an older verifier, which ignores VerifyRequest.stream_joined
        self.answer_delay_s = 0.0   # AddRequests' answer comes this long after the join (its first token) was taken

    async def AddRequests(self, request, context):
        if any(BAD_TOKEN in seq.prompt_token_ids for seq in request.seqs):  # all or nothing, like the real one
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt does not fit max_model_len")
        if self.add_delay_s:
            self.adds_in_flight += 1
            self.max_adds_in_flight = max(self.max_adds_in_flight, self.adds_in_flight)
            try:
                await asyncio.sleep(self.add_delay_s)
            finally:
                self.adds_in_flight -= 1
        outputs = []
        for seq in request.seqs:
            assert seq.request_id not in self.committed and len(self.committed) < NUM_SLOTS
            self.committed[seq.request_id] = list(seq.prompt_token_ids) + [toy_next(list(seq.prompt_token_ids))]
            outputs.append(engine_pb2.SeqOutput(request_id=seq.request_id, token_ids=[self.committed[seq.request_id][-1]]))
            if self._joined_ids is not None:
                self._joined_ids.append(seq.request_id)
        self.max_slots_used = max(self.max_slots_used, len(self.committed))
        if self.answer_delay_s:   # the call decodes the joins meanwhile: its partials may come first
            await asyncio.sleep(self.answer_delay_s)
        return engine_pb2.AddRequestsResponse(outputs=outputs)

    async def Verify(self, request, context):
        if self.joins_decode and request.num_decode_steps > 1:
            self._joined_ids = []
        await asyncio.sleep(self.delay_s)
        joined, self._joined_ids = self._joined_ids or [], None
        if self.is_failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier rank lost")
        rows = decode_token_ids(request.draft_token_ids) if request.draft_token_ids.shape else [[]] * len(request.request_ids)
        if request.num_draft_tokens:  # ragged rows: the real drafts are each row's first k_i
            assert len(request.num_draft_tokens) == len(rows)
            assert all(set(row[k_i:]) <= {-1} for row, k_i in zip(rows, request.num_draft_tokens))
            rows = [row[:k_i] for row, k_i in zip(rows, request.num_draft_tokens)]
        if request.has_draft_probs and request.data_plane == engine_pb2.DATA_PLANE_INLINE:
            self._check_probs(request)
        elif request.has_draft_probs:  # dist: probs come from the drafter, never through the coordinator
            assert request.data_plane == engine_pb2.DATA_PLANE_DIST and not request.HasField("draft_probs")
            self.num_dist_fetches += 1
        if request.num_decode_steps > 1:  # multi-step decoding: plain decode only
            assert not any(rows)
            self.decode_steps_seen.append(request.num_decode_steps)
            self.max_decode_steps_seen.append((list(request.request_ids), list(request.max_decode_steps)))
            return self._decode(request, joined)
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

    async def VerifyStream(self, request, context):
        """``Verify``; a multi-step call streams each step's tokens (one partial message per
        step, ``delay_s`` spread over the steps; a row stops at its ``max_decode_steps`` cap),
        then the whole call (``call_ends_s``: when). ``joins_decode``: a request added during
        the call decodes a token in each of its steps after the one that took it (its first
        token went with the add); with ``stream_joined`` the partials carry those too."""
        if request.num_decode_steps <= 1:
            yield await self.Verify(request, context)
            return
        if self.is_failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier rank lost")
        if self.joins_decode:
            self._joined_ids = []
        self.decode_steps_seen.append(request.num_decode_steps)
        self.stream_intervals_seen.append(request.stream_interval)
        self.stream_interval_ms_seen.append(request.stream_interval_ms)
        self.max_decode_steps_seen.append((list(request.request_ids), list(request.max_decode_steps)))
        rows: dict[str, list[int]] = {rid: [] for rid in request.request_ids}
        joined: dict[str, list[int]] = {}
        caps = dict(zip(request.request_ids, _caps(request)))
        for _ in range(request.num_decode_steps):
            await asyncio.sleep(self.delay_s / request.num_decode_steps)
            running = [rid for rid, out in rows.items() if len(out) < caps[rid]]
            for request_id in running:
                rows[request_id].append(toy_next(self.committed[request_id] + rows[request_id]))
            decoding = [rid for rid in joined if rid in self.committed]
            for request_id in decoding:
                joined[request_id].append(toy_next(self.committed[request_id] + joined[request_id]))
            for request_id in self._joined_ids or ():   # taken in this step: they decode from the next
                joined.setdefault(request_id, [])
            outputs = [engine_pb2.SeqOutput(request_id=rid, token_ids=rows[rid][-1:], logprobs=[-0.25]) for rid in running]
            if request.stream_joined and self.streams_joined:
                outputs += [engine_pb2.SeqOutput(request_id=rid, token_ids=joined[rid][-1:], logprobs=[-0.25])
                            for rid in decoding]
            yield engine_pb2.VerifyResponse(step_id=request.step_id, is_partial=True, outputs=outputs)
        self._joined_ids = None
        whole = self._decode(request)
        assert [list(out.token_ids) for out in whole.outputs] == list(rows.values())
        for request_id, out in joined.items():
            if request_id in self.committed and out:
                self.committed[request_id] += out
                whole.outputs.append(engine_pb2.SeqOutput(request_id=request_id, token_ids=out,
                                                          logprobs=[-0.25] * len(out)))
        self.call_ends_s.append(time.perf_counter())
        yield whole

    def _decode(self, request, joined: list[str] = ()):
        """The named rows' ``num_decode_steps`` tokens, then (``joins_decode``) those of the
        requests added during the call: all but one step, their first token went with the add."""
        outputs = []
        rows = list(zip(request.request_ids, _caps(request)))
        for request_id, num_steps in rows + [(rid, request.num_decode_steps - 1) for rid in joined
                                             if rid in self.committed]:
            seq, out = self.committed[request_id], []
            for _ in range(num_steps):
                out.append(toy_next(seq + out))
            seq += out
            outputs.append(engine_pb2.SeqOutput(request_id=request_id, token_ids=out, logprobs=[-0.25] * len(out)))
        return engine_pb2.VerifyResponse(step_id=request.step_id, outputs=outputs, verify_ms=self.delay_s * 1e3)

    def _check_probs(self, request) -> None:
        b, k, vocab = request.draft_probs.shape
        values = struct.unpack(f"<{b * k * vocab}f", request.draft_probs.data)
        ks = list(request.num_draft_tokens) or [k] * b
        for i, (request_id, k_i) in enumerate(zip(request.request_ids, ks)):  # real rows, then zero padding
            assert set(values[i * k * vocab : i * k * vocab + k_i * vocab]) == {_row_value(request_id)}
            assert set(values[i * k * vocab + k_i * vocab : (i + 1) * k * vocab]) <= {0.0}
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
        ks = [seq.num_draft_tokens if seq.HasField("num_draft_tokens") else k for seq in request.seqs]
        for seq, k_i in zip(request.seqs, ks):
            known = self.known[seq.request_id]
            assert 0 < seq.start_position <= len(known)
            known[seq.start_position :] = list(seq.token_ids)
            assert known == self.verifier.committed[seq.request_id], "catch-up protocol broken"
            drafts: list[int] = []
            for i in range(k_i):
                true = toy_next(known + drafts)
                is_right = _unit(seq.request_id, len(known), i) < self.accuracy
                drafts.append(true if is_right else (true + 1) % VOCAB)
            self.last_drafts[seq.request_id] = (len(known), drafts)
            self.last_step_ids[seq.request_id] = request.step_id
            rows.append(drafts + [-1] * (k - k_i))
        response = engine_pb2.DraftResponse(step_id=request.step_id, draft_token_ids=encode_token_ids(rows),
                                            num_draft_tokens=ks)
        is_sampled = any(self.sampling[s.request_id].temperature > 0 for s in request.seqs)
        if is_sampled and request.data_plane == engine_pb2.DATA_PLANE_DIST:
            response.has_draft_probs = True  # kept drafter-side for the verifier to fetch
        elif is_sampled:
            values = [_row_value(s.request_id) if i < k_i * VOCAB else 0.0
                      for s, k_i in zip(request.seqs, ks) for i in range(k * VOCAB)]
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


def _caps(request) -> list[int]:
    """Each named row's decode steps in a multi-step ``VerifyRequest`` (its ``max_decode_steps`` cap;
    ``decode_step_caps`` raises ValueError on bad caps, as the verifier refuses them)."""
    from specdec.engine.worker_base import decode_step_caps

    return decode_step_caps(request.num_decode_steps, list(request.max_decode_steps), len(request.request_ids))
