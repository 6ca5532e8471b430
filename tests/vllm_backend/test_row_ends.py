"""Rows of a multi-step decode call that end before the call does, on the vLLM backend (run in
``.venv-vllm``; ``specdec.vllm_backend.row_ends``).

Checked, on both the ``ar`` engine (``PsdAsyncScheduler``) and an engine with speculation
(``PsdScheduler``): a row capped at c (``max_steps``) gets exactly c tokens, the greedy
reference's, while the others run all N steps; a row that samples one of its stop tokens stops
after it (the others go on); ``on_step`` flags exactly those rows' last outputs ``is_final``
and never shows them again; a stopped or capped request stays resident and decodes on in the
next call from where it stopped; a request joining the call stops at its stop token too and
the call still ends; bad caps are refused.
"""
from __future__ import annotations

import pytest

from specdec.sample.sampling import SamplingParams
from step_recorder import decode_recorded
from test_call_joins import _StepHook
from test_multi_step_decode import GREEDY, _hf_greedy, _prompt, ar_target, model, sd_target  # noqa: F401 (fixtures)


@pytest.fixture(params=["ar_target", "sd_target"])
def target(request):
    return request.getfixturevalue(request.param)


def test_capped_rows_get_their_cap_and_the_others_every_step(target, model) -> None:
    rows = {"a": _prompt(11, 9), "b": _prompt(12, 14), "c": _prompt(13, 6)}
    refs = {rid: _hf_greedy(model[1], p, 12) for rid, p in rows.items()}
    target.add_requests([(rid, p, GREEDY) for rid, p in rows.items()])
    try:
        tokens, seen, final = decode_recorded(target, rows, 8, [3, 8, 5])
        assert tokens == {"a": refs["a"][1:4], "b": refs["b"][1:9], "c": refs["c"][1:6]}
        assert seen == {"a": [1, 2, 3], "b": list(range(1, 9)), "c": [1, 2, 3, 4, 5]}
        assert final == {"a": [3], "c": [5]}   # b ends with the call: not flagged
        again, _, _ = decode_recorded(target, ["a"], 3)   # resident, goes on from its 4th token
        assert again == {"a": refs["a"][4:7]}
    finally:
        for rid in rows:
            target.release(rid)


def test_a_row_stops_after_its_stop_token(target, model) -> None:
    rows = {"s": _prompt(21, 10), "t": _prompt(22, 7)}
    refs = {rid: _hf_greedy(model[1], p, 12) for rid, p in rows.items()}
    stop = refs["s"][3]      # s's 3rd decoded token (its first came with its prefill)
    stop_at = refs["s"][1:].index(stop) + 1
    params = {"s": SamplingParams(temperature=0.0, seed=0, stop_token_ids=(stop,)), "t": GREEDY}
    target.add_requests([(rid, p, params[rid]) for rid, p in rows.items()])
    try:
        tokens, seen, final = decode_recorded(target, rows, 8)
        assert tokens["t"] == refs["t"][1:9]
        # stopped after the stop token (the async scheduler may have run one step more)
        assert tokens["s"][:stop_at] == refs["s"][1:stop_at + 1] and stop_at <= len(tokens["s"]) <= stop_at + 1
        assert final["s"][0] == stop_at and "t" not in final
        assert max(seen["s"]) <= stop_at + 1
        again, _, _ = decode_recorded(target, ["s"], 2)   # resident: decodes on where it stopped
        done = len(tokens["s"])
        assert again == {"s": refs["s"][done + 1:done + 3]}
    finally:
        for rid in rows:
            target.release(rid)


def test_a_joined_request_stops_at_its_stop_token_and_the_call_ends(ar_target, model) -> None:
    rows = {"x": _prompt(31, 12)}
    newcomer = _prompt(32, 9)
    refs = {rid: _hf_greedy(model[1], p, 14) for rid, p in {**rows, "new": newcomer}.items()}
    stop = refs["new"][2]
    joined = []
    ar_target.add_requests([("x", rows["x"], GREEDY)])
    try:
        params = SamplingParams(temperature=0.0, seed=0, stop_token_ids=(stop,))
        with _StepHook(ar_target, 2, lambda: joined.append(ar_target.join_running_call([("new", newcomer, params)]))):
            steps = {s.request_id: list(s.token_ids) for s in ar_target.decode(["x"], 10)}
        assert joined and joined[0].result()[0].token_ids == refs["new"][:1]
        assert steps["x"] == refs["x"][1:11]
        stop_at = refs["new"][1:].index(stop) + 1    # tokens after the first, up to the stop token
        assert steps["new"][:stop_at] == refs["new"][1:stop_at + 1] and len(steps["new"]) <= stop_at + 1
    finally:
        for rid in ("x", "new"):
            if rid in ar_target.request_ids:
                ar_target.release(rid)


def test_bad_caps_are_refused(ar_target) -> None:
    ar_target.add_requests([("q", _prompt(41, 5), GREEDY)])
    try:
        for bad in ([0], [2, 2], [-1]):
            with pytest.raises(ValueError, match="max_decode_steps"):
                ar_target.decode(["q"], 4, None, bad)
        assert len(ar_target.decode(["q"], 4, None, [9])[0].token_ids) == 4   # a cap above N: N
    finally:
        ar_target.release("q")
