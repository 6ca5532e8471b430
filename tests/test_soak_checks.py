"""The soak's verdicts (scripts/soak_checks.py) and stream handling (scripts/soak_workload.py):
failures in flight at a coordinator kill are counted apart, other failures are not excused, a
greedy output that differs from the ar reference is caught, a stream that never ends is hung,
leaked slots fail the goals."""
from __future__ import annotations

import asyncio
import os
import random
import sys
from types import SimpleNamespace

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from minedraft.v1 import common_pb2, generate_pb2  # noqa: E402
from soak_checks import check_greedy, classify, goals, summarize  # noqa: E402
from soak_workload import greedy_key, request_plan, run_one  # noqa: E402

KILLS = [{"service": "drafter", "killed_at": 10.0, "serving_at": 12.0},
         {"service": "coordinator", "killed_at": 50.0, "serving_at": 55.0}]


def _plan(temperature=0.0, max_tokens=4, stop=None, n=0, **penalties) -> dict:
    sampling = {"max_tokens": max_tokens, "temperature": temperature, **penalties}
    if stop:
        sampling["stop"] = stop
    return {"request_id": "r", "kind": "greedy", "prompt": "p", "sampling": sampling, "n": n, "best_of": 0,
            "abort": None}


def _failed(start, end, code="UNAVAILABLE") -> dict:
    return {"outcome": "failed", "code": code, "message": "x", "start": start, "end": end, "request_id": "f",
            "plan": _plan()}


def _completed(ids, plan=None, finish="length") -> dict:
    plan = plan or _plan(max_tokens=len(ids))
    return {"outcome": "completed", "start": 0.0, "end": 1.0, "request_id": "c", "plan": plan, "ttft_s": 0.1,
            "latency_s": 1.0, "choices": [{"finish_reason": finish, "token_ids": ids, "completion_tokens": len(ids)}]}


def test_classify_separates_kills_from_real_failures():
    assert classify(_failed(49.0, 50.5), KILLS) == "killed_in_flight"
    assert classify(_failed(49.0, 50.5, code="INTERNAL"), KILLS) == "killed_in_flight"  # reported by code
    assert classify(_failed(51.0, 51.1), KILLS) == "unavailable_while_down"
    assert classify(_failed(51.0, 51.1, code="INTERNAL"), KILLS) == "failed"
    assert classify(_failed(60.0, 61.0), KILLS) == "failed"  # long after the restart
    assert classify(_failed(9.0, 11.0), KILLS) == "failed"  # a drafter kill excuses nothing
    assert classify(_failed(1.0, 2.0), KILLS) == "failed"
    assert classify({"outcome": "hung", "start": 49.0, "end": 700.0}, KILLS) == "hung"


def test_check_greedy_exact_without_stop_prefix_with_stop():
    ref = {greedy_key(_plan()): [5, 6, 7, 8, 9, 10]}
    assert check_greedy(_completed([5, 6, 7, 8]), ref) == []
    assert check_greedy(_completed([5, 6, 9, 8]), ref)[0].startswith("c#0: differs from ar at token 2")
    assert check_greedy(_completed([5, 6], _plan(max_tokens=4), finish="stop"), ref)  # early end, no stop string
    assert check_greedy(_completed([5, 6], _plan(max_tokens=4, stop=["."]), finish="stop"), ref) == []
    assert check_greedy(_completed([5, 7], _plan(max_tokens=4, stop=["."]), finish="stop"), ref)
    penalised = _plan(max_tokens=4, repetition_penalty=1.3)
    assert check_greedy(_completed([5, 6, 7, 8], penalised), ref)[0].endswith("no reference for 'p|repetition_penalty=1.3'")


def test_summary_and_goals():
    ref = {greedy_key(_plan()): [5, 6, 7, 8]}
    results = [_completed([5, 6, 7, 8]), _failed(49.0, 50.5), {**_completed([1]), "outcome": "aborted"}]
    summary = summarize(results, KILLS, ref, {"verifier": 0, "drafter": 0, "coordinator": 0}, 3.0)
    assert (summary["completed"], summary["aborted"], summary["failed"], summary["killed_in_flight"]) == (1, 1, 0, 1)
    assert (summary["greedy_compared"], summary["greedy_equal"], summary["leaked_slots"]) == (1, 1, 0)
    assert all(goals(summary, ("drafter", "coordinator")).values())
    assert not goals(summary, ("drafter", "coordinator", "drafter"))["kills_restarted"]
    leaky = summarize(results, KILLS, ref, {"verifier": 1, "drafter": 0, "coordinator": 0}, 3.0)
    assert goals(leaky, ("drafter", "coordinator")) == {**goals(summary, ("drafter", "coordinator")),
                                                        "no_leaked_slots": False}
    bad = summarize(results + [_completed([5, 6, 0, 8]), _failed(70.0, 71.0)], KILLS, ref, {"verifier": 0}, 3.0)
    assert not goals(bad, ())["greedy_equal_ar"] and not goals(bad, ())["no_failed"]


def test_plans_mix_every_kind():
    args = SimpleNamespace(min_tokens=8, max_tokens=24, abort_fraction=0.2)
    rng = random.Random(0)
    plans = [request_plan(rng, i, args) for i in range(500)]
    assert {p["kind"] for p in plans} == {"greedy", "seeded", "sampled", "penalty", "n2"}
    assert 0.12 < sum(p["abort"] is not None for p in plans) / len(plans) < 0.28
    assert any(p["n"] == 2 and p["best_of"] == 3 for p in plans) and any("stop" in p["sampling"] for p in plans)


class _Client:
    """A fake AsyncMineDraftClient whose stream sends ``responses`` then, if ``hang``, never ends."""

    def __init__(self, responses, hang=False) -> None:
        self.responses, self.hang, self.aborted = responses, hang, []

    async def stream(self, request):
        for response in self.responses:
            yield response
        if self.hang:
            await asyncio.sleep(3600)

    async def abort(self, request_id):
        self.aborted.append(request_id)
        return True


def _complete(index, ids, reason="length"):
    return generate_pb2.GenerateResponse(complete=generate_pb2.GenerateComplete(
        index=index, output_token_ids=ids, finish_reason=reason, usage=common_pb2.Usage(completion_tokens=len(ids))))


def test_run_one_hung_stream_and_n_choices():
    chunk = generate_pb2.GenerateResponse(chunk=generate_pb2.GenerateChunk(token_ids=[3]))
    plan = _plan(n=2)
    hung = asyncio.run(run_one(_Client([chunk, _complete(0, [3])], hang=True), plan, deadline_s=0.2))
    assert hung["outcome"] == "hung" and hung["end"] - hung["start"] < 5
    both = asyncio.run(run_one(_Client([chunk, _complete(1, [4]), _complete(0, [3])]), plan, deadline_s=5))
    assert both["outcome"] == "completed" and [c["token_ids"] for c in both["choices"]] == [[3], [4]]
    short = asyncio.run(run_one(_Client([_complete(0, [3])]), plan, deadline_s=5))
    assert short["outcome"] == "failed" and "1 of 2 completes" in short["message"]
    client = _Client([chunk, _complete(0, [3], "abort"), _complete(1, [3], "abort")])
    aborted = asyncio.run(run_one(client, {**plan, "abort": ("rpc", 1)}, deadline_s=5))
    assert aborted["outcome"] == "aborted" and client.aborted == ["r"]


class _RpcError(grpc.RpcError):
    def __init__(self, code, details) -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class _FlakyClient(_Client):
    """Raises ``errors`` (one per call) before serving the responses."""

    def __init__(self, responses, errors) -> None:
        super().__init__(responses)
        self.errors, self.calls = list(errors), 0

    async def stream(self, request):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        for response in self.responses:
            yield response


def test_run_one_resends_only_refused_requests():
    refused = _RpcError(grpc.StatusCode.UNAVAILABLE, "coordinator: failed to connect to all addresses")
    client = _FlakyClient([_complete(0, [3])], [refused, refused])
    result = asyncio.run(run_one(client, _plan(), deadline_s=5))
    assert result["outcome"] == "completed" and result["retries"] == 2 and client.calls == 3
    cut = _RpcError(grpc.StatusCode.UNAVAILABLE, "coordinator: Stream removed (Socket closed)")
    result = asyncio.run(run_one(_FlakyClient([_complete(0, [3])], [cut]), _plan(), deadline_s=5))
    assert result["outcome"] == "failed" and result["retries"] == 0  # in flight: not hidden by a retry
    result = asyncio.run(run_one(_FlakyClient([_complete(0, [3])], [refused]), _plan(), deadline_s=5, retry_refused=False))
    assert result["outcome"] == "failed" and result["code"] == "UNAVAILABLE"
