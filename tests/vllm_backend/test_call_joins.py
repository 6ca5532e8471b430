"""Requests joining a running multi-step decode call on the vLLM backend (run in ``.venv-vllm``):
``VllmTargetWorker.join_running_call`` from another thread while ``decode`` runs N steps.

Checked: a join is prefilled between two of the call's steps and its future resolves before
the call returns, with the greedy reference's first token; it decodes in the call's remaining
steps (at most its ``max_tokens``), those tokens returned after the rows'; the call's rows keep
their reference tokens; the joined request decodes in later calls like any other; no running call -> None;
a refused join (an id already resident) fails alone; a join submitted as the call ends is
prefilled before it returns; the ``verifier_svc`` layer answers it as an ``AddRequestsResponse``.
"""
from __future__ import annotations

import pytest

from conftest import _build_tiny_llama
from minedraft.v1 import common_pb2, engine_pb2
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.engine import VllmEngineConfig
from specdec.vllm_backend.scheduler import PsdStep
from specdec.vllm_backend.target import VllmTargetWorker
from test_multi_step_decode import GREEDY, MAX_LEN, SHAPE, _hf_greedy, _prompt
from verifier_svc.engine import VerifierEngine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    net = _build_tiny_llama(num_layers=2, seed=1, **SHAPE)
    path = str(tmp_path_factory.mktemp("target"))
    net.save_pretrained(path, safe_serialization=True)
    return path, net


@pytest.fixture(scope="module")
def worker(model):
    return VllmTargetWorker(VllmEngineConfig(model=model[0], max_num_seqs=4, max_model_len=MAX_LEN, enforce_eager=True,
                                             kv_cache_space_gib=0.05, async_scheduling=True))


class _StepHook:
    """Wraps the engine core's step (``engine_core.get_output``, what ``core_step`` reads): counts
    steps and runs ``action`` before step ``at``."""

    def __init__(self, worker, at: int, action) -> None:
        self.worker, self.at, self.action, self.num_steps = worker, at, action, 0
        self.original = worker.engine.engine_core.get_output

    def __enter__(self):
        def step():
            self.num_steps += 1
            if self.num_steps == self.at:
                self.action()
            return self.original()

        self.worker.engine.engine_core.get_output = step
        return self

    def __exit__(self, *exc) -> None:
        self.worker.engine.engine_core.get_output = self.original


def test_a_join_is_prefilled_inside_the_call_and_decodes_after_it(worker, model) -> None:
    rows = {"x": _prompt(1, 12), "y": _prompt(2, 20)}
    newcomer = _prompt(3, 17)
    refs = {rid: _hf_greedy(model[1], p, 14) for rid, p in {**rows, "new": newcomer}.items()}
    out = {o.request_id: list(o.token_ids) for o in worker.add_requests([(r, p, GREEDY) for r, p in rows.items()])}
    joined, resolved_at = [], []
    try:
        def submit():
            future = worker.join_running_call([("new", newcomer, GREEDY)])
            future.add_done_callback(lambda f: resolved_at.append(hook.num_steps))
            joined.append(future)

        with _StepHook(worker, 3, submit) as hook:
            steps = worker.decode(list(rows), 8)
            num_call_steps = hook.num_steps
        assert joined and joined[0].done() and resolved_at[0] < num_call_steps, (resolved_at, num_call_steps)
        first = joined[0].result()
        assert [s.request_id for s in first] == ["new"] and first[0].token_ids == refs["new"][:1]
        assert [s.request_id for s in steps] == ["x", "y", "new"]   # the joined request decoded in the call too
        for s in steps[:2]:
            assert len(s.token_ids) == 8
            out[s.request_id] += s.token_ids
        assert out == {rid: refs[rid][:9] for rid in rows}
        in_call = steps[2].token_ids                                   # its tokens after the first
        assert 1 <= len(in_call) <= 6 and in_call == refs["new"][1:1 + len(in_call)]
        assert len(steps[2].logprobs) == len(in_call) and steps[2].num_accepted == 0
        n = 1 + len(in_call)
        assert worker.decode(["new"], 5)[0].token_ids == refs["new"][n:n + 5]
        assert worker.decode(list(rows), 2)[0].token_ids == refs["x"][9:11]
    finally:
        for rid in [*rows, "new"]:
            if rid in worker.request_ids:
                worker.release(rid)


def test_a_streamed_call_hands_on_its_joined_rows_tokens_after_the_first(worker, model) -> None:
    """``on_step`` sees the joined request's tokens too, after its first (which its join
    answered), in the steps that decode them: per request, what the steps handed on is what the
    call returns; and a verifier engine that was not asked to (``stream_joined`` false) streams
    the named rows only."""
    rows = {"x": _prompt(21, 12)}
    newcomer = _prompt(22, 15)
    refs = {rid: _hf_greedy(model[1], p, 10) for rid, p in {**rows, "new": newcomer}.items()}
    worker.add_requests([(r, p, GREEDY) for r, p in rows.items()])
    streamed: dict[str, list[int]] = {}
    joined = []

    def on_step(steps) -> None:
        for s in steps:
            streamed.setdefault(s.request_id, []).extend(s.token_ids)

    try:
        with _StepHook(worker, 3, lambda: joined.append(worker.join_running_call([("new", newcomer, GREEDY)]))):
            steps = worker.decode(list(rows), 8, on_step)
        returned = {s.request_id: s.token_ids for s in steps}
        assert joined[0].result(timeout=0)[0].token_ids == refs["new"][:1]
        assert len(returned["new"]) >= 2 and streamed == returned, (streamed, returned)
        assert returned["new"] == refs["new"][1:1 + len(returned["new"])]
    finally:
        for rid in [*rows, "new"]:
            if rid in worker.request_ids:
                worker.release(rid)


def test_a_join_whose_sibling_prefills_in_chunks_answers_with_its_first_token_only(worker, model) -> None:
    """Two requests in one join, the second's prompt too long for the step's token budget: the
    first decodes on while the second finishes its prefill, yet the join answers each with its
    first token and the call returns the first's later tokens once (no token twice)."""
    short, long = _prompt(13, 20), _prompt(14, 80)
    assert len(short) + len(long) + 1 > worker.cfg.batched_tokens      # the long prompt takes two steps
    refs = {"short": _hf_greedy(model[1], short, 9), "long": _hf_greedy(model[1], long, 9)}
    worker.add_requests([("x", _prompt(15, 10), GREEDY)])
    joined = []
    try:
        with _StepHook(worker, 2, lambda: joined.append(
                worker.join_running_call([("short", short, GREEDY), ("long", long, GREEDY)]))):
            steps = worker.decode(["x"], 8)
        assert [o.token_ids for o in joined[0].result(timeout=0)] == [refs["short"][:1], refs["long"][:1]]
        later = {s.request_id: s.token_ids for s in steps[1:]}
        assert len(later["short"]) >= 2                                  # it decoded while "long" prefilled
        for rid, tokens in later.items():
            assert tokens == refs[rid][1:1 + len(tokens)], rid
    finally:
        for rid in ("x", "short", "long"):
            if rid in worker.request_ids:
                worker.release(rid)


def test_no_running_call_takes_no_join(worker) -> None:
    assert worker.join_running_call([("z", _prompt(4, 5), GREEDY)]) is None
    assert "z" not in worker.request_ids


def test_a_join_decodes_no_more_than_its_max_tokens(worker, model) -> None:
    rows, newcomer = {"x": _prompt(11, 10)}, _prompt(12, 7)
    worker.add_requests([(r, p, GREEDY) for r, p in rows.items()])
    joined = []
    two = SamplingParams(temperature=0.0, seed=0, max_tokens=2)
    try:
        with _StepHook(worker, 2, lambda: joined.append(worker.join_running_call([("new", newcomer, two)]))):
            steps = worker.decode(["x"], 8)
        assert joined[0].result(timeout=0)[0].token_ids == _hf_greedy(model[1], newcomer, 1)
        assert [s.request_id for s in steps] == ["x", "new"] and steps[1].token_ids == _hf_greedy(model[1], newcomer, 2)[1:]
    finally:
        for rid in ("x", "new"):
            if rid in worker.request_ids:
                worker.release(rid)


def test_a_failed_call_fails_its_taken_join_and_forgets_it(worker, model) -> None:
    worker.add_requests([("x", _prompt(13, 9), GREEDY)])
    futures, hooks_after = [], []

    def on_step(steps) -> None:   # the second engine step after the join's submission: its prefill step
        if futures:
            hooks_after.append(1)
            if len(hooks_after) == 2:
                raise RuntimeError("hook died")
    try:
        with _StepHook(worker, 2, lambda: futures.append(worker.join_running_call([("j", _prompt(14, 6), GREEDY)]))):
            with pytest.raises(RuntimeError, match="hook died"):
                worker.decode(["x"], 6, on_step=on_step)
        with pytest.raises(RuntimeError, match="hook died"):
            futures[0].result(timeout=0)
        assert worker.request_ids == ["x"]
        assert [rid for rid, _ in worker._names.values()] == ["x"]   # core_step's id map forgot the join
        assert [s.external_req_id for s in worker.engine.output_processor.request_states.values()] == ["x"]
    finally:
        worker.release("x")


def test_a_refused_join_fails_alone(worker, model) -> None:
    worker.add_requests([("x", _prompt(5, 9), GREEDY)])
    futures = []
    try:
        with _StepHook(worker, 2, lambda: futures.append(worker.join_running_call([("x", _prompt(6, 4), GREEDY)]))):
            steps = worker.decode(["x"], 4)
        assert len(steps[0].token_ids) == 4
        with pytest.raises(ValueError, match="new and distinct"):
            futures[0].result(timeout=0)
        assert worker.request_ids == ["x"]
    finally:
        worker.release("x")


def test_a_join_submitted_as_the_call_ends_is_prefilled_before_it_returns(worker, model) -> None:
    """The call's last ``set_step`` (to the empty step) comes before it stops taking joins."""
    late_prompt = _prompt(8, 11)
    worker.add_requests([("x", _prompt(7, 9), GREEDY)])
    futures, original = [], worker.scheduler.set_step

    def set_step(step):
        if step is not None and not step.request_ids and not futures:
            futures.append(worker.join_running_call([("late", late_prompt, GREEDY)]))
        original(step)

    worker.scheduler.set_step = set_step
    try:
        worker.decode(["x"], 3)
        assert futures[0] is not None and futures[0].done()
        assert futures[0].result()[0].token_ids == _hf_greedy(model[1], late_prompt, 1)
        assert sorted(worker.request_ids) == ["late", "x"]
    finally:
        worker.scheduler.set_step = original
        for rid in ("x", "late"):
            if rid in worker.request_ids:
                worker.release(rid)


def test_the_verifier_engine_answers_a_join_as_add_requests(worker, model) -> None:
    engine = VerifierEngine(worker, seed=0)
    engine.add(engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id="x", prompt_token_ids=_prompt(9, 6))]))
    newcomer = _prompt(10, 8)
    add = engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id="j", prompt_token_ids=newcomer)])
    results = []
    try:
        assert engine.join_call(add)[1] is None          # no call running: the caller adds it itself
        with _StepHook(worker, 2, lambda: results.append(engine.join_call(add))):   # as the service thread would
            engine.verify(engine_pb2.VerifyRequest(request_ids=["x"], num_decode_steps=4), engine_pb2.DATA_PLANE_INLINE)
        checked, future = results[0]
        assert checked.seqs[0].sampling.HasField("seed")       # seeded before it joined
        response = future.result(timeout=0)
        assert [o.request_id for o in response.outputs] == ["j"] and len(response.outputs[0].token_ids) == 1
        assert "j" in engine.request_ids                        # known before the response is seen
        with pytest.raises(ValueError, match="already active"):
            engine.join_call(add)
    finally:
        engine.release(engine_pb2.ReleaseRequest(request_ids=["x", "j"]))


@pytest.mark.parametrize("stream_joined", [True, False])
def test_the_verifier_engine_streams_joined_rows_only_when_asked(worker, stream_joined: bool) -> None:
    engine = VerifierEngine(worker, seed=0)
    engine.add(engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id="x", prompt_token_ids=_prompt(11, 6))]))
    sampling = common_pb2.SamplingParams(max_tokens=16, ignore_eos=True)
    add = engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id="j", prompt_token_ids=_prompt(12, 8),
                                                                 sampling=sampling)])
    emitted: dict[str, int] = {}

    def on_step(outputs) -> None:
        for out in outputs:
            emitted[out.request_id] = emitted.get(out.request_id, 0) + len(out.token_ids)

    try:
        with _StepHook(worker, 2, lambda: engine.join_call(add)):
            response = engine.verify(engine_pb2.VerifyRequest(request_ids=["x"], num_decode_steps=6, stream_interval=1,
                                                              stream_joined=stream_joined),
                                     engine_pb2.DATA_PLANE_INLINE, on_step)
        whole = {o.request_id: len(o.token_ids) for o in response.outputs}
        assert whole["x"] == 6 and whole["j"] >= 2
        assert emitted["x"] == 5                      # the last step's token only in the whole response
        assert ("j" in emitted) == stream_joined and emitted.get("j", 0) in ((whole["j"] - 1, whole["j"]) if
                                                                            stream_joined else (0,))
    finally:
        engine.release(engine_pb2.ReleaseRequest(request_ids=["x", "j"]))


def test_the_verifier_engine_reports_its_calls_engine_core_time(worker) -> None:
    engine = VerifierEngine(worker, seed=0)
    engine.add(engine_pb2.AddRequestsRequest(seqs=[engine_pb2.SeqInit(request_id="x", prompt_token_ids=_prompt(13, 6))]))
    try:
        for num_steps in (6, 3):
            response = engine.verify(engine_pb2.VerifyRequest(request_ids=["x"], num_decode_steps=num_steps),
                                     engine_pb2.DATA_PLANE_INLINE)
            assert len(response.outputs[0].token_ids) == num_steps == response.num_engine_steps   # one step per token
            assert 0 < response.engine_core_ms < response.verify_ms
    finally:
        engine.release(engine_pb2.ReleaseRequest(request_ids=["x"]))


def test_psd_step_join_gives_one_step_and_keeps_the_counts() -> None:
    step = PsdStep(frozenset({"a"}), num_steps=8)
    assert step.quota("a") == 8 and step.quota("b") == 8
    joined = PsdStep(step.request_ids | {"b"}, num_steps=8, num_steps_of={"b": 1})
    assert joined.quota("a") == 8 and joined.quota("b") == 1


def test_call_joins_say_whether_a_join_waits() -> None:
    from specdec.vllm_backend.joining import CallJoins

    joins = CallJoins()
    assert not joins.has_pending() and joins.submit([("a", [1], GREEDY)]) is None   # no call running
    joins.open()
    assert not joins.has_pending()
    future = joins.submit([("a", [1], GREEDY)])
    assert future is not None and joins.has_pending()
    assert [j.future for j in joins.take()] == [future] and not joins.has_pending()
    joins.submit([("b", [1], GREEDY)])
    assert len(joins.close()) == 1 and not joins.has_pending()
