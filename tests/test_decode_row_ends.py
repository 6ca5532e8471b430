"""Rows of a multi-step decode call that end before the call does (``VerifyRequest.max_decode_steps``,
stop tokens), on the native engine, the verifier service and the coordinator. (The vLLM
backend's: tests/vllm_backend/test_row_ends.py.)

Checked: the native worker gives a capped row exactly its cap of tokens and stops a row after a
stop token (``SamplingParams.stop_token_set``: stop ids, EOS unless ``ignore_eos``), the others
decoding on, every token the uncapped reference's; ``on_step`` flags those rows' last outputs
``is_final``; ``StepCoalescer`` sends such a row at once, alone; through ``VerifyStream`` a row
capped at 3 in a 10-step call with a partial every 8 steps arrives in a partial of its own
before the first 8-step one; bad caps are refused naming ``max_decode_steps`` (over gRPC:
INVALID_ARGUMENT, and the next call is served); the coordinator
sends each request's tokens left as its cap, and outputs stay the reference.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.stepping import _row_caps
from coordinator_harness import Harness, _expected, wait_until
from minedraft.v1 import common_pb2, engine_pb2
from specdec.engine.worker_base import StepOutput
from specdec.sample.sampling import SamplingParams
from step_recorder import decode_recorded
from test_multi_step_decode import PROMPTS, _worker
from verifier_svc.engine import VerifierEngine
from verifier_svc.streaming import StepCoalescer

GREEDY = SamplingParams(temperature=0.0, seed=0, ignore_eos=True)


def _reference(tiny_llama, params: dict, num_steps: int) -> dict[str, list[int]]:
    worker = _worker(tiny_llama)
    worker.add_requests([(rid, p, GREEDY) for rid, p in PROMPTS.items()])
    return {o.request_id: list(o.token_ids) for o in worker.decode(list(PROMPTS), num_steps)}


def test_native_capped_rows_get_their_cap(tiny_llama) -> None:
    ref = _reference(tiny_llama, GREEDY, 10)
    worker = _worker(tiny_llama)
    worker.add_requests([(rid, p, GREEDY) for rid, p in PROMPTS.items()])
    tokens, seen, final = decode_recorded(worker, PROMPTS, 8, [3, 8, 20])
    assert tokens == {"a": ref["a"][:3], "b": ref["b"][:8], "c": ref["c"][:8]}
    assert seen["a"] == [1, 2, 3] and seen["b"] == seen["c"] == list(range(1, 9))
    assert final == {"a": [3]}     # b and c end with the call (c's cap 20 > 8): not flagged
    again, _, _ = decode_recorded(worker, ["a"], 2)
    assert again == {"a": ref["a"][3:5]}


def test_native_row_stops_after_its_stop_token_and_eos_unless_ignored(tiny_llama) -> None:
    ref = _reference(tiny_llama, GREEDY, 10)
    stop = ref["b"][2]
    stop_at = ref["b"].index(stop) + 1
    eos = _worker(tiny_llama).facts().eos_token_ids
    params = {"a": GREEDY, "b": SamplingParams(temperature=0.0, seed=0, ignore_eos=True, stop_token_ids=(stop,)),
              "c": SamplingParams(temperature=0.0, seed=0, stop_token_ids=())}
    assert params["b"].stop_token_set(eos) == {stop} and params["c"].stop_token_set(eos) == frozenset(eos)
    worker = _worker(tiny_llama)
    worker.add_requests([(rid, p, params[rid]) for rid, p in PROMPTS.items()])
    tokens, seen, final = decode_recorded(worker, PROMPTS, 8)
    assert tokens["a"] == ref["a"][:8] and tokens["b"] == ref["b"][:stop_at]
    assert final["b"] == [stop_at] and max(seen["b"]) == stop_at
    eos_at = next((i + 1 for i, t in enumerate(ref["c"][:8]) if t in eos), None)
    assert tokens["c"] == ref["c"][:eos_at or 8] and final.get("c") == ([eos_at] if eos_at and eos_at < 8 else None)


def test_step_coalescer_sends_a_final_row_at_once_alone() -> None:
    emitted: list[list] = []
    hook = StepCoalescer(emitted.append, 8)
    hook([StepOutput("a", [1], 0, [-0.1]), StepOutput("b", [2], 0, [-0.2])])
    hook([StepOutput("a", [3], 0, [-0.3], is_final=True), StepOutput("b", [4], 0, [-0.4])])
    assert len(emitted) == 1 and [(o.request_id, list(o.token_ids)) for o in emitted[0]] == [("a", [1, 3])]
    for n in range(6):
        hook([StepOutput("b", [5 + n], 0, [-0.5])])
    assert len(emitted) == 2 and [(o.request_id, list(o.token_ids)) for o in emitted[1]] == [("b", [2, 4, 5, 6, 7, 8, 9, 10])]


def _serve_verify_stream(tiny_llama, *requests: engine_pb2.VerifyRequest) -> list:
    """Through a served ``VerifierServicer`` (native float64 engine, ``PROMPTS`` added greedily):
    per request, its ``VerifyStream`` messages, or the ``grpc.aio.AioRpcError`` it ended with."""
    from coordinator_harness import _serve
    from minedraft.serving import aio_channel
    from minedraft.v1 import engine_pb2_grpc
    from verifier_svc.servicer import VerifierServicer

    sampling = common_pb2.SamplingParams(temperature=0.0, seed=3, ignore_eos=True, max_tokens=50)
    add = engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id=rid, prompt_token_ids=p, sampling=sampling)
                                              for rid, p in PROMPTS.items()])

    async def main():
        servicer = VerifierServicer("tiny", engine_pb2.DATA_PLANE_INLINE)
        servicer.attach(VerifierEngine(_worker(tiny_llama), seed=0))
        server, address = await _serve(engine_pb2_grpc.add_VerifierServicer_to_server, servicer,
                                       "minedraft.v1.Verifier")
        results = []
        try:
            async with aio_channel(address) as channel:
                stub = engine_pb2_grpc.VerifierStub(channel)
                await stub.AddRequests(add)
                for request in requests:
                    try:
                        results.append([m async for m in stub.VerifyStream(request)])
                    except grpc.aio.AioRpcError as exc:
                        results.append(exc)
            return results
        finally:
            await server.stop(None)

    return asyncio.run(main())


def test_verify_stream_sends_a_capped_row_before_the_interval(tiny_llama) -> None:
    verify = engine_pb2.VerifyRequest(step_id=5, request_ids=list(PROMPTS), num_decode_steps=10, stream_interval=8,
                                      max_decode_steps=[10, 3, 10], data_plane=engine_pb2.DATA_PLANE_INLINE)
    messages, = _serve_verify_stream(tiny_llama, verify)
    rows = [[(o.request_id, len(o.token_ids)) for o in m.outputs] for m in messages]
    assert rows[0] == [("b", 3)] and messages[0].is_partial, rows    # b alone, at its 3rd step
    assert rows[1] == [("a", 8), ("c", 8)] and messages[1].is_partial, rows
    assert rows[2] == [("a", 10), ("b", 3), ("c", 10)] and not messages[2].is_partial, rows


def test_bad_caps_get_invalid_argument_and_the_verifier_serves_on(tiny_llama) -> None:
    bad = engine_pb2.VerifyRequest(step_id=1, request_ids=list(PROMPTS), num_decode_steps=6, max_decode_steps=[2, 0, 2])
    good = engine_pb2.VerifyRequest(step_id=2, request_ids=list(PROMPTS), num_decode_steps=6, max_decode_steps=[2, 6, 4])
    refused, served = _serve_verify_stream(tiny_llama, bad, good)
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_decode_steps" in refused.details()
    assert [len(o.token_ids) for o in served[-1].outputs] == [2, 6, 4]


def test_verifier_refuses_bad_caps(tiny_llama) -> None:
    engine = VerifierEngine(_worker(tiny_llama), seed=0)
    engine.add(engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id="a", prompt_token_ids=[5, 9])]))
    for steps, caps in ((4, [0]), (4, [2, 2]), (1, [1])):
        with pytest.raises(ValueError, match="max_decode_steps"):
            engine.verify(engine_pb2.VerifyRequest(request_ids=["a"], num_decode_steps=steps, max_decode_steps=caps),
                          engine_pb2.DATA_PLANE_INLINE)
    ok = engine.verify(engine_pb2.VerifyRequest(request_ids=["a"], num_decode_steps=4, max_decode_steps=[2]),
                       engine_pb2.DATA_PLANE_INLINE)
    assert len(ok.outputs[0].token_ids) == 2


def test_coordinator_caps_each_row_at_its_tokens_left() -> None:
    work = [("short", [5, 9, 17], {"max_tokens": 4, "ignore_eos": True}),
            ("long", [7, 1, 30], {"max_tokens": 30, "ignore_eos": True})]

    async def run():
        async with Harness(mode="ar", max_num_seqs=3, num_decode_steps=8, delay_s=0.1) as h:
            long = asyncio.ensure_future(h.generate(*work[1][:2], **work[1][2]))
            await wait_until(lambda: h.verifier.decode_steps_seen)   # long's first 8-step call runs
            short = await h.generate(*work[0][:2], **work[0][2])
            return [short, await long], h.verifier.max_decode_steps_seen, h.verifier.decode_steps_seen

    results, calls, steps = asyncio.run(run())
    for (rid, prompt, sampling), (tokens, reason, _) in zip(work, results):
        assert tokens == _expected(prompt, sampling) and reason == "length", rid
    # short (3 tokens left after its first) in an 8-step call with long: capped at 3, long at its own
    both = [(ids, caps) for ids, caps in calls if "short" in ids and "long" in ids]
    assert both and all(caps and caps[ids.index("short")] == 3 for ids, caps in both), calls
    assert all(caps == [] for ids, caps in calls if ids == ["long"]), calls   # alone: each call <= its tokens left


def test_row_caps_only_where_a_row_would_stop_early() -> None:
    class R:
        def __init__(self, max_tokens, emitted):
            self.finish_params = type("F", (), {"max_tokens": max_tokens})()
            self.output_token_ids = [0] * emitted

    assert _row_caps([R(5, 2), R(40, 1)], 8) == [3, 39]
    assert _row_caps([R(40, 2), R(40, 1)], 8) == []
    assert _row_caps([R(3, 1)], 1) == []
