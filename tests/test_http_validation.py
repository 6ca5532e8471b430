"""HTTP API body validation (found by a break-it review): an in-process gateway (GatewayServicer +
HttpServer, tests/test_http_robustness.py) in front of the fake coordinator of tests/gateway_harness.py.

Checked: JSON ``true`` / ``false`` where a number is expected (every integer and float field, token
ids in ``prompt`` and ``stop_token_ids``) is 400 naming the field, not read as 1 / 0; for ``prompt``
(a union of string and token-id types) the message says so rather than "should be a valid string";
a body error's message drops pydantic's "Value error, " prefix.
Chat messages: a role the chat template cannot render (anything but system, user, assistant) is 400
naming ``messages[i].role``; null content is 400 naming ``messages[i].content`` but in an assistant
message with tool calls (as in OpenAI); content as a list of text parts is joined.
"""
from __future__ import annotations

import json

import pytest

from test_http_robustness import _post, gateway  # noqa: F401  (module fixture: in-process gateway, fake coordinator)

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def port(gateway, tokenizer) -> int:  # noqa: F811  (the imported fixture)
    servicer, port = gateway
    servicer.script, servicer.step_delay_s, servicer.error = [tokenizer.encode("ok", add_special_tokens=False)], 0.0, None
    return port


def _assert_400(port: int, route: str, body: dict, param: str) -> dict:
    status, response = _post(port, f"/v1/{route}", json.dumps(body))
    assert status == 400, response
    error = response["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", response
    assert error["message"].startswith(param), response
    return error


BOOLS = [  # (route, body, OpenAI param): each was served with true read as 1 (false as 0)
    *[("completions", {"prompt": "hi", field: True}, field)
      for field in ("max_tokens", "n", "seed", "top_k", "logprobs", "temperature", "top_p", "min_p",
                    "presence_penalty", "frequency_penalty")],
    ("completions", {"prompt": "hi", "top_p": False}, "top_p"),
    ("completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("completions", {"prompt": [True, False]}, "prompt[0]"),
    ("completions", {"prompt": [[True]]}, "prompt[0][0]"),
    *[("chat/completions", {"messages": CHAT, "logprobs": True, field: True}, field)
      for field in ("max_completion_tokens", "max_tokens", "top_logprobs", "temperature", "seed", "n")],
]


@pytest.mark.parametrize("route,body,param", BOOLS, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(BOOLS)])
def test_a_bool_where_a_number_is_expected_is_400_naming_the_field(port, route, body, param):
    error = _assert_400(port, route, body, param)
    assert "expected a number, got " in error["message"], error  # not a coincidental 400 (penalty, top_p 0)
    assert "Value error" not in error["message"], error  # pydantic's prefix is dropped
    status, response = _post(port, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "top_p": 1}))
    assert status == 200 and response["choices"][0]["text"] == "ok"  # numbers still pass (int for a float too)


def test_body_error_message_reads_without_pydantic_prefix(port):
    error = _assert_400(port, "completions", {"prompt": "hi", "max_tokens": True}, "max_tokens")
    assert error["message"] == "max_tokens: expected a number, got true", error  # was "max_tokens: Value error, ..."


def _chat(*messages: dict) -> dict:
    return {"messages": list(messages), "max_tokens": 2}


ASSISTANT = {"role": "assistant", "content": "hello"}
BAD_MESSAGES = [  # (body, OpenAI param): each was served
    (_chat({"role": "wizard", "content": "hi"}), "messages[0].role"),
    (_chat(CHAT[0], ASSISTANT, {"role": "tool", "content": "42"}), "messages[2].role"),
    (_chat({"role": "developer", "content": "be brief"}, CHAT[0]), "messages[0].role"),
    (_chat({"role": "User", "content": "hi"}), "messages[0].role"),
    (_chat({"role": "user", "content": None}), "messages[0].content"),
    (_chat({"role": "user"}), "messages[0].content"),
    (_chat({"role": "system", "content": None}, CHAT[0]), "messages[0].content"),
    (_chat(CHAT[0], {"role": "assistant", "content": None}, CHAT[0]), "messages[1].content"),
]


@pytest.mark.parametrize("body,param", BAD_MESSAGES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_MESSAGES)])
def test_bad_chat_message_is_400_naming_it(port, body, param):
    _assert_400(port, "chat/completions", body, param)


def test_served_chat_messages(gateway, port, tokenizer):
    fake, _ = gateway
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for body in (_chat({"role": "system", "content": "be brief"}, CHAT[0], ASSISTANT, CHAT[0]),
                 _chat(CHAT[0], {"role": "assistant", "content": None, "tool_calls": [tool_call]}, CHAT[0])):
        status, response = _post(port, "/v1/chat/completions", json.dumps(body))
        assert status == 200 and response["choices"][0]["message"]["content"] == "ok", response
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    status, _ = _post(port, "/v1/chat/completions", json.dumps(_chat({"role": "user", "content": parts})))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                             tokenize=False)
    assert status == 200 and list(fake.requests[-1].prompt_token_ids) == tokenizer.encode(rendered,
                                                                                          add_special_tokens=False)
