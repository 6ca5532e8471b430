"""OpenAI-compatible requests the HTTP API once refused with 400 (found by a break-it review), served
as vLLM's OpenAI server serves them: an in-process gateway (tests/test_http_robustness.py) in front of
the fake coordinator of tests/gateway_harness.py.

Checked: JSON ``null`` in an optional field is served as if the field were not given (the coordinator
gets the same request); unserved options at their no-op value (``response_format`` text,
``logit_bias`` ``{}``, ``tool_choice`` "none" / "auto" without tools) and ignored ones
(``user``, ``parallel_tool_calls``, ``service_tier``, ``metadata``, ``store``) are served; any other
value of an unserved option is 400 naming it, and ``null`` does not make an unknown or required field
pass.
"""
from __future__ import annotations

import json

import pytest

from test_http_robustness import _post, gateway  # noqa: F401  (module fixture: in-process gateway, fake coordinator)
from test_http_validation import _assert_400, port  # noqa: F401  (fixture: the gateway's port, replies "ok")

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
SHARED_NULLS = ("n", "stream", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "user",
                "stream_options", "logprobs", "response_format")
NULLS = [("completions", COMPLETION, {field: None for field in (*SHARED_NULLS, "best_of", "echo")}),
         ("chat/completions", CHAT, {field: None for field in (*SHARED_NULLS, "top_logprobs", "tool_choice", "tools",
                                                              "parallel_tool_calls", "service_tier", "metadata",
                                                              "store")})]


def _served(port: int, route: str, body: dict) -> dict:  # noqa: F811
    status, response = _post(port, f"/v1/{route}", json.dumps(body))
    assert status == 200, response
    choice = response["choices"][0]
    assert (choice["text"] if route == "completions" else choice["message"]["content"]) == "ok", response
    return response


@pytest.mark.parametrize("route,base,nulls", NULLS, ids=["completions", "chat"])
def test_null_reads_as_not_given(gateway, port, route, base, nulls):  # noqa: F811
    fake, _ = gateway
    _served(port, route, base)
    expected = fake.requests[-1]
    for field, value in nulls.items():  # one at a time: each was refused alone
        _served(port, route, {**base, field: value})
    response = _served(port, route, {**base, **nulls})
    sent = fake.requests[-1]
    assert (sent.prompt_token_ids, sent.sampling) == (expected.prompt_token_ids, expected.sampling)
    assert response["choices"][0].get("logprobs") is None and "usage" in response  # not streamed, no logprobs
    _served(port, route, {**base, "stream_options": {"include_usage": None}, "stream": False})


ACCEPTED = [  # (route, extra fields): each was 400 ("Extra inputs are not permitted")
    *[(route, extra) for route in ("completions", "chat/completions")
      for extra in ({"response_format": {"type": "text"}}, {"logit_bias": {}})],
    ("completions", {"best_of": 1}),
    ("chat/completions", {"tool_choice": "none"}),
    ("chat/completions", {"tool_choice": "auto"}),
    ("chat/completions", {"tool_choice": "auto", "tools": []}),
    ("chat/completions", {"parallel_tool_calls": False}),
    ("chat/completions", {"service_tier": "auto", "metadata": {"team": "a"}, "store": False}),
]


@pytest.mark.parametrize("route,extra", ACCEPTED, ids=[f"{r}-{'-'.join(e)}" for r, e in ACCEPTED])
def test_no_op_options_are_served(gateway, port, route, extra):  # noqa: F811
    fake, _ = gateway
    base = COMPLETION if route == "completions" else CHAT
    _served(port, route, base)
    expected = fake.requests[-1].sampling
    _served(port, route, {**base, **extra})
    assert fake.requests[-1].sampling == expected


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
REFUSED = [  # (route, body, OpenAI param, message part): an option whose effect this server cannot give
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format", "structured output"),
    ("completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "structured output"),
    ("completions", {**COMPLETION, "logit_bias": {"50": -100}}, "logit_bias", "not served"),
    ("chat/completions", {**CHAT, "logit_bias": {"50": 5}}, "logit_bias", "not served"),
    ("completions", {**COMPLETION, "best_of": 2, "stream": True}, "best_of", "cannot be used with stream"),
    ("completions", {**COMPLETION, "best_of": 0}, "best_of", "must be >= 1"),
    ("chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "not served"),
    ("chat/completions", {**CHAT, "tool_choice": "auto", "tools": [TOOL]}, "tool_choice", "not served"),
    ("chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "got an object"),
    ("chat/completions", {**CHAT, "tools": [TOOL]}, "tools", "not served"),
    ("chat/completions", {**CHAT, "tool_choice": "none", "tools": [TOOL]}, "tools", "not served"),
]
STILL_REFUSED = [  # (route, body, OpenAI param): null does not pass an unknown or required field
    ("completions", {**COMPLETION, "frobnicate": None}, "frobnicate"),
    ("completions", {**COMPLETION, "prompt": None}, "prompt"),
    ("chat/completions", {**CHAT, "messages": None}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
]


@pytest.mark.parametrize("route,body,param,says", REFUSED,
                         ids=[f"{r}-{p}-{i}" for i, (r, _, p, _) in enumerate(REFUSED)])
def test_unserved_option_values_are_400_naming_them(port, route, body, param, says):  # noqa: F811
    error = _assert_400(port, route, body, param)
    assert says in error["message"], error  # not pydantic's "Extra inputs are not permitted"


@pytest.mark.parametrize("route,body,param", STILL_REFUSED, ids=[p for _, _, p in STILL_REFUSED])
def test_null_does_not_pass_unknown_or_required_fields(port, route, body, param):  # noqa: F811
    _assert_400(port, route, body, param)
