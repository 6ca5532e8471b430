"""``n`` > 1 and ``best_of`` over HTTP (issue 25): the in-process gateway of
tests/test_http_robustness.py in front of the fake coordinator (``is_seeded_sampling``: a sampled
request's tokens and logprobs are a function of its seed).

Checked: n choices with index 0..n-1 (completions and chat), greedy ones equal to n = 1, seeded
ones reproducible and different; usage counts the prompt once and sums the rest; streaming
chunks carry their choice index, each choice gets its finish chunk, the usage chunk comes last;
best_of returns the n with the highest cumulative logprob and is 400 with stream; n and
best_of out of range are 400 naming them.
"""
from __future__ import annotations

import json

import pytest

from test_http_robustness import _post, gateway  # noqa: F401  (module fixture: in-process HTTP gateway)

TEXT = " The quick brown fox"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def port(gateway, tokenizer) -> int:  # noqa: F811
    fake, port = gateway
    fake.script = [[i] for i in tokenizer.encode(TEXT, add_special_tokens=False)]
    fake.step_delay_s, fake.error, fake.is_seeded_sampling = 0.0, None, True
    yield port
    fake.is_seeded_sampling = False


def _ok(port: int, route: str, body: dict) -> dict:
    status, response = _post(port, f"/v1/{route}", json.dumps(body))
    assert status == 200, response
    return response


def _texts(response: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in response["choices"]]


@pytest.mark.parametrize("route,base", [("completions", {"prompt": "hi"}), ("chat/completions", {"messages": CHAT})])
def test_greedy_n_choices_equal_n1_and_usage_counts_the_prompt_once(port, route, base):
    one = _ok(port, route, {**base, "max_tokens": 8, "temperature": 0})
    three = _ok(port, route, {**base, "max_tokens": 8, "temperature": 0, "n": 3})
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert _texts(three) == _texts(one) * 3
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert three["usage"]["total_tokens"] == one["usage"]["prompt_tokens"] + 3 * one["usage"]["completion_tokens"]
    assert three["usage"]["minedraft"]["num_drafts"] == 3 * one["usage"]["minedraft"]["num_drafts"]


def test_seeded_n_is_reproducible_and_choices_differ(port):
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    first, again = _ok(port, "completions", body), _ok(port, "completions", body)
    assert _texts(first) == _texts(again) and len(set(_texts(first))) == 3
    single = _ok(port, "completions", {**body, "n": 1, "seed": 8})
    assert _texts(single) == _texts(first)[1:2]  # choice i samples with seed + i


def _events(port: int, route: str, body: dict) -> list[dict]:
    status, raw = _post(port, f"/v1/{route}", json.dumps({**body, "stream": True}))
    assert status == 200, raw
    text = raw["raw"]
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route,base,key", [("completions", {"prompt": "hi"}, "text"),
                                            ("chat/completions", {"messages": CHAT}, "content")])
def test_stream_chunks_carry_their_choice_index(port, route, base, key):
    events = _events(port, route, {**base, "max_tokens": 8, "temperature": 0, "n": 2,
                                   "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    for index in (0, 1):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        text = "".join(c["text"] if key == "text" else c["delta"].get("content", "") for c in mine)
        assert text == TEXT and [c["finish_reason"] for c in mine][-1] == "length"
        assert sum(c["finish_reason"] is not None for c in mine) == 1
        if key == "content":
            assert mine[0]["delta"]["role"] == "assistant"
            assert all("role" not in c["delta"] for c in mine[1:])


def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(port):
    # seeds 7..10: logprob per token -0.1 * (1 + seed % 5) -> seed 10 best, then 7
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 1.0, "seed": 7, "logprobs": 0}
    best = _ok(port, "completions", {**body, "n": 2, "best_of": 4})
    singles = [_ok(port, "completions", {**body, "seed": s}) for s in (10, 7)]
    assert _texts(best) == [_texts(s)[0] for s in singles]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["choices"][0]["logprobs"]["token_logprobs"] == singles[0]["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"prompt": "hi", "n": 17}, "n"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ("completions", {"prompt": "hi", "best_of": 17}, "best_of"),
    ("completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
    ("chat/completions", {"messages": CHAT, "n": 17}, "n"),
    ("chat/completions", {"messages": CHAT, "n": -1}, "n"),
    ("chat/completions", {"messages": CHAT, "best_of": 2}, "best_of"),  # not a chat field
])
def test_n_and_best_of_out_of_range_are_400_naming_them(port, route, body, param):
    status, response = _post(port, f"/v1/{route}", json.dumps(body))
    assert status == 400 and response["error"]["param"] == param, response
    assert response["error"]["message"].startswith(f"{param}: "), response
