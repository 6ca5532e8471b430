"""Multi-step decoding (``--decode-steps N``): an ``ar`` step decodes N tokens per request in one
Verify call. Checked: the native worker's N steps equal N single steps token for token and
logprob for logprob; the verifier refuses bad ``num_decode_steps``; the coordinator gives the
same outputs as one token per call (stop ids, EOS, ``max_tokens`` mid-block) with fewer steps,
never asks past a request's ``max_tokens`` or the context window, and counts tokens emitted.
(The vLLM backend's multi-step decode: tests/vllm_backend/test_psd_scheduler.py.)
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from coordinator.config import CoordinatorConfig
from coordinator.context_window import ContextLimits
from coordinator_harness import Harness, _expected, _workload
from minedraft.v1 import common_pb2, coordinator_pb2, engine_pb2
from specdec.config import CacheConfig, ModelConfig
from specdec.errors import CapacityError
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams
from specdec.engine.worker import TargetWorker
from verifier_svc.engine import MAX_DECODE_STEPS, VerifierEngine

PROMPTS = {"a": [5, 9, 17, 3], "b": [7, 7, 1, 30, 11, 2, 8], "c": [4]}


def _worker(tiny_llama, max_model_len: int = 64) -> TargetWorker:
    runner = ModelRunner(ModelConfig(), CacheConfig(max_num_seqs=4, max_model_len=max_model_len),
                         model=tiny_llama(dtype=torch.float64))
    return TargetWorker(runner, seed=0)


def _add(worker: TargetWorker, params: SamplingParams) -> dict[str, list[int]]:
    outs = worker.add_requests([(rid, p, params) for rid, p in PROMPTS.items()])
    return {o.request_id: list(o.token_ids) for o in outs}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_native_decode_steps_equal_single_steps(tiny_llama, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=11, logprobs=2)
    single, multi = _worker(tiny_llama), _worker(tiny_llama)
    one, many = _add(single, params), _add(multi, params)
    one_lp = {rid: [] for rid in PROMPTS}
    for _ in range(9):
        for out in single.verify(list(PROMPTS), [[] for _ in PROMPTS], None):
            one[out.request_id] += out.token_ids
            one_lp[out.request_id] += out.logprobs
    many_lp = {rid: [] for rid in PROMPTS}
    for n in (4, 1, 4):
        for out in multi.decode(list(PROMPTS), n):
            assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs) == n
            assert out.num_accepted == 0
            many[out.request_id] += out.token_ids
            many_lp[out.request_id] += out.logprobs
    assert many == one
    assert many_lp == one_lp


def test_native_decode_stops_at_the_context_window(tiny_llama) -> None:
    worker = _worker(tiny_llama, max_model_len=16)
    _add(worker, SamplingParams(temperature=0.0, seed=0))
    outs = worker.decode(list(PROMPTS), 40)
    # "b" (7 prompt tokens) fills the 16-token window first; every row stops with it
    assert {len(o.token_ids) for o in outs} == {16 - 7}
    with pytest.raises(CapacityError):
        worker.decode(["b"], 2)
    with pytest.raises(ValueError, match="num_steps"):
        worker.decode(["a"], 0)


def test_verifier_refuses_bad_num_decode_steps(tiny_llama) -> None:
    engine = VerifierEngine(_worker(tiny_llama), seed=0)
    engine.add(engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id="a", prompt_token_ids=[5, 9])]))
    too_many = engine_pb2.VerifyRequest(request_ids=["a"], num_decode_steps=MAX_DECODE_STEPS + 1)
    with pytest.raises(ValueError, match="num_decode_steps"):
        engine.verify(too_many, engine_pb2.DATA_PLANE_INLINE)
    from coordinator.engines import encode_token_ids

    with_drafts = engine_pb2.VerifyRequest(request_ids=["a"], num_decode_steps=2,
                                           draft_token_ids=encode_token_ids([[3, 4]], is_ragged=True))
    with pytest.raises(ValueError, match="num_decode_steps"):
        engine.verify(with_drafts, engine_pb2.DATA_PLANE_INLINE)
    response = engine.verify(engine_pb2.VerifyRequest(request_ids=["a"], num_decode_steps=5), engine_pb2.DATA_PLANE_INLINE)
    assert len(response.outputs[0].token_ids) == 5


def test_config_refuses_bad_decode_steps() -> None:
    for bad in (0, 65):
        with pytest.raises(ValueError, match="num_decode_steps"):
            CoordinatorConfig(num_decode_steps=bad)
        with pytest.raises(ValueError, match="stream_interval"):
            CoordinatorConfig(stream_interval=bad)
    for bad in (-1, 60_001):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            CoordinatorConfig(stream_interval_ms=bad)


def test_decode_room_follows_the_verifier_window() -> None:
    assert ContextLimits(verifier_max_model_len=100).decode_room(96) == 4
    assert ContextLimits().decode_room(96) > 1000


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "block"])
@pytest.mark.parametrize("mode", ["ar", "auto"])
def test_coordinator_multi_step_output_equals_reference(mode: str, stream: bool) -> None:
    work = _workload(12)   # max_tokens 6..28, stop ids, ignore_eos: finishes inside a decoded block

    async def run(num_decode_steps: int):
        async with Harness(mode=mode, max_num_seqs=3, num_speculative_tokens=3,
                           num_decode_steps=num_decode_steps, stream_decode_steps=stream) as h:
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            status = await h.stub.GetStatus(coordinator_pb2.StatusRequest())
            metric = h.scheduler.metrics.registry.get_sample_value
            emitted = metric("minedraft:generation_tokens_total")
            return results, status.num_steps, h.verifier.decode_steps_seen, emitted

    one, steps_one, seen_one, _ = asyncio.run(run(1))
    many, steps_many, seen_many, emitted = asyncio.run(run(6))
    assert not seen_one
    for (rid, prompt, sampling), (tokens, reason, usage) in zip(work, many):
        assert tokens == _expected(prompt, sampling), rid
        assert usage.completion_tokens == len(tokens) and reason in ("stop", "length")
    assert [r[:2] for r in many] == [r[:2] for r in one]
    assert emitted == sum(len(tokens) for tokens, _, _ in many)
    if mode == "ar":
        assert seen_many and max(seen_many) == 6 and steps_many < steps_one / 2
        longest = max(s["max_tokens"] for _, _, s in work)
        assert all(2 <= n <= min(6, longest) for n in seen_many)


async def _stream(h, rid: str, prompt: list[int], max_tokens: int, started: asyncio.Event | None = None,
                  on_chunk=None) -> list[int]:
    """One Generate stream through the harness: its tokens; each chunk sets ``started`` and calls
    ``on_chunk(request id, the chunk's token count, tokens so far)``."""
    call = h.stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)))
    tokens: list[int] = []
    async for response in call:
        if response.WhichOneof("response") == "chunk":
            tokens += response.chunk.token_ids
            if on_chunk is not None:
                on_chunk(rid, len(response.chunk.token_ids), len(tokens))
            if started is not None:
                started.set()
    return tokens


@contextlib.asynccontextmanager
async def _call_running(joins_decode: bool, delay_s: float, on_chunk=None):
    """A harness (``ar``, unstreamed 8-step calls of ``delay_s``) whose request "a" has its first
    token and whose first Verify call runs: yields (harness, a's stream task)."""
    async with Harness(mode="ar", max_num_seqs=4, num_decode_steps=8, delay_s=delay_s,
                       stream_decode_steps=False) as h:
        h.verifier.joins_decode = joins_decode
        first = asyncio.Event()
        a = asyncio.ensure_future(_stream(h, "a", [5, 9, 17], 17, first, on_chunk))
        await first.wait()
        yield h, a


@pytest.mark.parametrize("joins_decode", [False, True], ids=["native-like", "vllm-like"])
def test_a_request_arriving_during_a_multi_step_call_is_admitted_at_once(joins_decode: bool) -> None:
    """``ar`` with ``--decode-steps``: a newcomer's prefill goes to the verifier while the
    running Verify call decodes (the coordinator does not wait for the call to end), so its first
    token (TTFT) comes before the running request's next block; both outputs stay the reference.
    vLLM-like: the newcomer also decodes in that call (its tokens come back after the named
    rows') and they are streamed after its first token. (Unstreamed calls, whose tokens come at
    their end; streamed ones: the next test.)"""
    events: list[tuple[str, int]] = []

    def record(rid: str, num_new: int, num_tokens: int) -> None:
        events.append((rid, num_tokens))

    async def run():
        async with _call_running(joins_decode, 0.4, record) as (h, a):
            await asyncio.sleep(0.05)
            b = await _stream(h, "b", [7, 1, 30], 9, on_chunk=record)
            return await a, b

    a, b = asyncio.run(run())
    assert a == _expected([5, 9, 17], {"max_tokens": 17}) and b == _expected([7, 1, 30], {"max_tokens": 9})
    first_of_b = events.index(("b", 1))
    assert [e for e in events[:first_of_b] if e[0] == "a"] == [("a", 1)], events  # before a's 2nd block
    b_events = [n for rid, n in events if rid == "b"]
    assert b_events[:2] == ([1, 8] if joins_decode else [1, 9]), events  # vLLM-like: 7 more within a's call


@pytest.mark.parametrize("joins_decode", [False, True], ids=["native-like", "vllm-like"])
def test_requests_arriving_during_a_call_are_admitted_beside_each_other(joins_decode: bool) -> None:
    """A request that arrives while an earlier newcomer's prefill is still under way during the
    running call is sent to the verifier at once, not after that prefill (their AddRequests
    overlap); every output stays the reference."""
    async def run():
        async with _call_running(joins_decode, 1.0) as (h, a):
            h.verifier.add_delay_s = 0.3    # each newcomer's prefill takes 0.3 s from now on
            b = asyncio.ensure_future(_stream(h, "b", [7, 1, 30], 9))
            await asyncio.sleep(0.1)        # "b" is prefilling when "c" arrives
            c = await _stream(h, "c", [4, 2], 5)
            return await a, await b, c, h.verifier.max_adds_in_flight

    a, b, c, max_in_flight = asyncio.run(run())
    assert a == _expected([5, 9, 17], {"max_tokens": 17}) and b == _expected([7, 1, 30], {"max_tokens": 9})
    assert c == _expected([4, 2], {"max_tokens": 5})
    assert max_in_flight == 2


def test_a_request_finishing_inside_a_streamed_call_ends_before_the_call() -> None:
    """Streamed multi-step calls (``stream_decode_steps``, the default): each step's token
    reaches the stream as the verifier decodes it, so a request whose ``max_tokens`` falls inside
    a call finishes before that call ends, and a closed-loop client's next request is admitted
    inside the same call; every output stays the reference. A request that joined a call
    streams its tokens after the first as the call decodes them too (``stream_joined``), not at
    the call's end."""
    import time

    first: dict[str, float] = {}
    ends: dict[str, float] = {}
    chunks: dict[str, list[int]] = {}
    chunk_times: dict[str, list[float]] = {}
    long_started = asyncio.Event()

    def record(rid: str, num_new: int, num_tokens: int) -> None:
        chunks.setdefault(rid, []).append(num_new)
        chunk_times.setdefault(rid, []).append(time.perf_counter())
        first.setdefault(rid, time.perf_counter())

    async def stream(h, rid: str, prompt: list[int], max_tokens: int):
        tokens = await _stream(h, rid, prompt, max_tokens, long_started, record)
        ends[rid] = time.perf_counter()
        return tokens

    async def closed_loop(h):
        await long_started.wait()   # long's first 8-step call runs: short joins it
        short = await stream(h, "short", [7, 1, 30], 12)
        return short, await stream(h, "next", [4, 4, 9], 4)

    async def run():
        async with Harness(mode="ar", max_num_seqs=4, num_decode_steps=8, delay_s=0.8, stream_interval=3) as h:
            h.verifier.joins_decode = True
            long, (short, after) = await asyncio.gather(stream(h, "long", [5, 9, 17], 17), closed_loop(h))
            return long, short, after, list(h.verifier.call_ends_s), (h.verifier.stream_intervals_seen,
                                                                        h.verifier.stream_interval_ms_seen)

    long, short, after, call_ends, (intervals, intervals_ms) = asyncio.run(run())
    assert intervals_ms == [50, 50]   # the coordinator's default stream_interval_ms
    assert intervals == [3, 3]   # the coordinator's stream_interval, in each call (this verifier streams every step)
    assert long == _expected([5, 9, 17], {"max_tokens": 17})
    assert short == _expected([7, 1, 30], {"max_tokens": 12}) and after == _expected([4, 4, 9], {"max_tokens": 4})
    assert chunks["long"] == [1] + [1] * 16, chunks       # named in both calls: a chunk per step
    assert chunks["short"] == [1] * 12, chunks             # joined call 1, named in call 2: a chunk per step
    in_call_1 = [t for t in chunk_times["short"] if t < call_ends[0]]
    assert len(in_call_1) >= 4, (chunk_times["short"], call_ends)   # its first token, then 3+ of call 1's steps
    assert len(call_ends) == 2 and ends["short"] < call_ends[1], (ends, call_ends)  # after 4 of call 2's 8 steps
    assert first["next"] < call_ends[1], (first, call_ends)  # admitted inside call 2


@pytest.mark.parametrize("stream_joined", [True, False], ids=["joined-streamed", "old-verifier"])
def test_a_joined_requests_streamed_tokens_wait_for_its_first_token(stream_joined: bool) -> None:
    """The partial messages of the call a newcomer joined carry its tokens after the first while
    its AddRequests answer (the first token) is still on its way: the coordinator holds them
    until that answer has been committed, so the stream is the reference in order. A verifier
    that streams named rows only (``stream_joined`` ignored) gives the same output."""
    events: list[tuple[str, int]] = []

    def record(rid: str, num_new: int, num_tokens: int) -> None:
        events.append((rid, num_tokens))

    async def run():
        async with Harness(mode="ar", max_num_seqs=4, num_decode_steps=8, delay_s=0.8, stream_interval=1) as h:
            h.verifier.joins_decode, h.verifier.streams_joined = True, stream_joined
            started = asyncio.Event()
            a = asyncio.ensure_future(_stream(h, "a", [5, 9, 17], 17, started, record))
            await started.wait()
            h.verifier.answer_delay_s = 0.35   # ~3 of the call's 0.1 s steps pass before b's first token comes
            b = await _stream(h, "b", [7, 1, 30], 9, on_chunk=record)
            return await a, b

    a, b = asyncio.run(run())
    assert a == _expected([5, 9, 17], {"max_tokens": 17}) and b == _expected([7, 1, 30], {"max_tokens": 9})
    b_counts = [n for rid, n in events if rid == "b"]
    assert b_counts[0] == 1 and b_counts[-1] == 9, events
    if stream_joined:   # what was held came right after the first token, one chunk each
        first_of_b = events.index(("b", 1))
        assert events[first_of_b + 1: first_of_b + 3] == [("b", 2), ("b", 3)], events


def _stream_and_unary(tiny_llama, num_steps: int, stream_interval: int = 0):
    """Through a served ``VerifierServicer`` over the native float64 engine: the messages of one
    ``VerifyStream`` call of ``num_steps`` steps (a partial every ``stream_interval``), and a twin
    engine's unary ``Verify`` of it."""
    from coordinator_harness import _serve
    from minedraft.serving import aio_channel
    from minedraft.v1 import engine_pb2_grpc
    from verifier_svc.servicer import VerifierServicer

    # ignore_eos: the tiny model samples its EOS now and then, which would end a row early
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=3, logprobs=1, ignore_eos=True)
    add = engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id=rid, prompt_token_ids=p, sampling=sampling)
                                              for rid, p in PROMPTS.items()])
    verify = engine_pb2.VerifyRequest(step_id=7, request_ids=list(PROMPTS), num_decode_steps=num_steps,
                                      stream_interval=stream_interval,
                                      data_plane=engine_pb2.DATA_PLANE_INLINE)
    twin = VerifierEngine(_worker(tiny_llama), seed=0)
    twin.add(add)
    unary = twin.verify(verify, engine_pb2.DATA_PLANE_INLINE)

    async def main():
        servicer = VerifierServicer("tiny", engine_pb2.DATA_PLANE_INLINE)
        servicer.attach(VerifierEngine(_worker(tiny_llama), seed=0))
        server, address = await _serve(engine_pb2_grpc.add_VerifierServicer_to_server, servicer,
                                       "minedraft.v1.Verifier")
        try:
            async with aio_channel(address) as channel:
                stub = engine_pb2_grpc.VerifierStub(channel)
                await stub.AddRequests(add)
                return [m async for m in stub.VerifyStream(verify)]
        finally:
            await server.stop(None)

    return asyncio.run(main()), unary


def test_verify_stream_partials_add_up_to_the_whole_response(tiny_llama) -> None:
    """A partial per step but the last, whose tokens only the whole response carries (it follows
    at once; steps the engine thread handed on before the service sent the previous partial go
    out together, so a loaded machine sends fewer); the partials are a prefix of the whole
    response, which equals the unary call's."""
    messages, unary = _stream_and_unary(tiny_llama, num_steps=6)
    *partials, whole = messages
    assert not whole.is_partial and all(m.is_partial for m in partials)
    assert 1 <= len(partials) <= 5 and all(m.step_id == 7 for m in messages)
    streamed = {rid: ([], []) for rid in PROMPTS}
    for message in partials:
        for out in message.outputs:
            streamed[out.request_id][0].extend(out.token_ids)
            streamed[out.request_id][1].extend(out.logprobs)
    whole_rows = {o.request_id: (list(o.token_ids), list(o.logprobs)) for o in whole.outputs}
    assert {rid: (t[:5], lp[:5]) for rid, (t, lp) in whole_rows.items()} == streamed
    assert {o.request_id: list(o.token_ids) for o in unary.outputs} == {r: t for r, (t, _) in whole_rows.items()}
    assert all(len(t) == 5 for t, _ in streamed.values()) and all(len(t) == 6 for t, _ in whole_rows.values())


def test_verify_stream_leaves_the_last_interval_to_the_whole_response(tiny_llama) -> None:
    """16 steps, a partial every 8: one partial (steps 1-8), then the whole response; the
    partial at step 16 would have come just before it."""
    messages, unary = _stream_and_unary(tiny_llama, num_steps=16, stream_interval=8)
    *partials, whole = messages
    assert len(partials) == 1 and all(len(o.token_ids) == 8 for o in partials[0].outputs)
    assert not whole.is_partial and whole.outputs == unary.outputs


def test_a_single_step_verify_stream_sends_only_the_whole_response(tiny_llama) -> None:
    messages, unary = _stream_and_unary(tiny_llama, num_steps=1)
    assert len(messages) == 1 and not messages[0].is_partial
    assert messages[0].outputs == unary.outputs


def test_verify_stream_sends_a_partial_per_stream_interval_steps(tiny_llama) -> None:
    """``VerifyRequest.stream_interval`` 4 over 10 steps: each partial carries at least 4 steps of
    every row, the partials are a prefix of the whole response, and fewer than 4 steps go unsent."""
    messages, unary = _stream_and_unary(tiny_llama, num_steps=10, stream_interval=4)
    *partials, whole = messages
    assert partials and not whole.is_partial and whole.outputs == unary.outputs
    streamed = {rid: [] for rid in PROMPTS}
    for message in partials:
        assert all(len(out.token_ids) >= 4 for out in message.outputs), message
        for out in message.outputs:
            streamed[out.request_id].extend(out.token_ids)
    for out in whole.outputs:
        assert list(out.token_ids[: len(streamed[out.request_id])]) == streamed[out.request_id]
        assert 10 - len(streamed[out.request_id]) < 4


def test_step_coalescer_merges_rows_over_the_interval_and_keeps_the_rest() -> None:
    """``StepCoalescer``: every 3 steps one ``SeqOutput`` per row that decoded meanwhile (its
    tokens, logprobs, top logprobs of those steps in order); a row absent from a step is merged
    from the steps it has; the last 1 step (< 3) is not emitted (the whole response carries it)."""
    from specdec.engine.worker_base import StepOutput
    from verifier_svc.streaming import StepCoalescer

    emitted: list[list] = []
    hook = StepCoalescer(emitted.append, 3)
    for step in range(7):
        rows = [StepOutput("a", [10 + step], 0, [-0.1 * step], [([10 + step], [-0.1 * step])])]
        if 1 <= step <= 4:
            rows.append(StepOutput("b", [20 + step], 0, [-1.0 - step]))
        hook(rows)
    assert len(emitted) == 2
    first, second = ({o.request_id: o for o in message} for message in emitted)
    assert list(first["a"].token_ids) == [10, 11, 12] and list(first["b"].token_ids) == [21, 22]
    assert list(first["b"].logprobs) == pytest.approx([-2.0, -3.0])
    assert [list(t.token_ids) for t in first["a"].top_logprobs] == [[10], [11], [12]]
    assert list(second["a"].token_ids) == [13, 14, 15] and list(second["b"].token_ids) == [23, 24]
    assert StepCoalescer(emitted.append, 0).interval == 1


def test_step_coalescer_also_emits_once_its_time_interval_passed(monkeypatch) -> None:
    """``interval_ms`` 50 beside ``interval`` 8: steps of 30 ms each (a fake clock) go out every
    second step (60 ms >= 50), not every 8th; without it, every 8th."""
    from specdec.engine.worker_base import StepOutput
    from verifier_svc import streaming

    clock = [100.0]
    monkeypatch.setattr(streaming.time, "perf_counter", lambda: clock[0])
    for interval_ms, expected in ((50, [2, 2, 2, 2]), (0, [8])):
        emitted: list[int] = []
        hook = streaming.StepCoalescer(lambda outs: emitted.append(len(outs[0].token_ids)), 8, 10, frozenset({"x"}),
                                       True, interval_ms)
        for step in range(10):
            clock[0] += 0.030
            hook([StepOutput("x", [step], 0, [-1.0])])
        assert emitted == expected, (interval_ms, emitted)   # steps 9-10: the whole response's


@pytest.mark.parametrize("stream_joined", [True, False])
def test_step_coalescer_counts_the_named_rows_steps_only(stream_joined: bool) -> None:
    """A joined row ("j") decodes beside the named row ("x") and then once more on its own after
    x's last (4th) step: the step count is x's, so nothing goes out from x's last step on (the
    whole response carries it); without ``stream_joined`` j's tokens are never emitted."""
    from specdec.engine.worker_base import StepOutput
    from verifier_svc.streaming import StepCoalescer

    emitted: list[dict] = []
    hook = StepCoalescer(lambda outs: emitted.append({o.request_id: list(o.token_ids) for o in outs}), 1, 4,
                         frozenset({"x"}), stream_joined)
    steps = [[("x", 1)], [("x", 2), ("j", 20)], [("x", 3), ("j", 21)], [("x", 4), ("j", 22)], [("j", 23)]]
    for rows in steps:
        hook([StepOutput(rid, [token], 0, [-1.0]) for rid, token in rows])
    if stream_joined:
        assert emitted == [{"x": [1]}, {"x": [2], "j": [20]}, {"x": [3], "j": [21]}]
    else:
        assert emitted == [{"x": [1]}, {"x": [2]}, {"x": [3]}]
