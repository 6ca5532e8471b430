"""Issue 25.6: HTTP 400 messages name the field as the HTTP body does, in one path style: the
request's own field names (``max_tokens``, ``top_logprobs``, ``prompt``), never the gRPC paths
(``sampling.max_tokens``, ``prompt_token_ids``), and ``messages[0].content`` for nested fields
(pydantic's own errors too, not ``messages.0.content``); ``param`` is that same name.

In-process gateway (tests/test_http_robustness.py) in front of the fake coordinator.
"""
from __future__ import annotations

import json
import re

import pytest

from test_http_robustness import _post, gateway  # noqa: F401  (module fixture: in-process HTTP gateway)

CHAT = [{"role": "user", "content": "hi"}]
COMPLETIONS = [  # (body, param): each named a gRPC path or another style before
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    ({"prompt": "hi " * 30, "max_tokens": 50}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop[0]"),
    ({"prompt": "hi", "stop": ["a", ""]}, "stop[1]"),
    ({"prompt": "hi", "stop": ""}, "stop"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids[0]"),
    ({"prompt": "hi", "stop_token_ids": [1, 10**6]}, "stop_token_ids[1]"),
    ({"prompt": [10**6]}, "prompt[0]"),
    ({"prompt": [1, 2, 10**6]}, "prompt[2]"),
    ({"prompt": [[1, 10**6]]}, "prompt[0][1]"),
    ({"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"prompt": "hi", "n": "2"}, "n"),
    ({"prompt": "hi", "best_of": "2"}, "best_of"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "hi", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
]
CHATS = [
    ({"messages": CHAT, "max_completion_tokens": 1000}, "max_completion_tokens"),
    ({"messages": CHAT, "max_tokens": 1000}, "max_tokens"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": CHAT, "temperature": -1}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [*CHAT, {"role": "user", "content": None}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
]
CASES = [("completions", b, p) for b, p in COMPLETIONS] + [("chat/completions", b, p) for b, p in CHATS]


@pytest.fixture
def port(gateway, tokenizer) -> int:  # noqa: F811
    fake, port = gateway
    fake.script, fake.step_delay_s, fake.error = [tokenizer.encode("ok", add_special_tokens=False)], 0.0, None
    return port


@pytest.mark.parametrize("route,body,param", CASES, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(CASES)])
def test_http_errors_name_the_field_as_the_body_does(port, route, body, param):
    status, response = _post(port, f"/v1/{route}", json.dumps(body))
    assert status == 400, response
    error = response["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    assert "sampling." not in error["message"] and "prompt_token_ids" not in error["message"], error
    assert not re.search(r"\.\d", error["param"]), error  # no messages.0.content style
