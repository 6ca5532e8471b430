"""HTTP API robustness (found by breaking a running stack): an in-process gateway (GatewayServicer +
HttpServer, no subprocess) in front of the fake coordinator of tests/gateway_harness.py.

Checked: values a JSON body can carry but the protobuf wire cannot (integers wider than the int32 /
int64 proto fields, lone UTF-16 surrogates such as ``"\\ud800"`` in text) are 400 naming the
OpenAI param, not 500; malformed JSON is 400 without a bogus param; a client that disconnects
before the response starts (non-streaming, or a stream still waiting for its first token) aborts
the request at the coordinator instead of leaving it to run to ``max_tokens``; text too long to fit
``max_model_len`` is refused before tokenizing (which blocks the gateway's event loop).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

from gateway.config import GatewayConfig
from gateway.http_server import HttpServer
from gateway.server import SERVICE_NAME, GatewayServicer
from gateway.tokenizer import PromptTokenizer
from gateway.validation import PROMPT_BYTES_SLACK, InvalidRequestError, prepare_request
from gateway_harness import FakeCoordinatorThread, _free_port
from minedraft.serving import ServingHealth
from minedraft.v1 import generate_pb2

MODEL = "tiny-robust-model"
ABORT_WAIT_S = 10.0


class InProcessHttpGateway:
    """GatewayServicer + HttpServer on a background event loop (the gateway's HTTP half)."""

    def __init__(self, tokenizer_dir: str, coordinator_port: int) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        cfg = GatewayConfig(tokenizer=tokenizer_dir, coordinator=f"127.0.0.1:{coordinator_port}", model_name=MODEL,
                            max_model_len=64, port=0, http_port=_free_port(), grace_s=1)
        self.servicer, self.server = self._call(self._start(cfg))
        self.port = self.server.port

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _start(self, cfg: GatewayConfig):
        servicer = GatewayServicer(cfg, PromptTokenizer(cfg.tokenizer))
        health = ServingHealth([SERVICE_NAME])
        await health.set_serving()
        server = HttpServer(cfg, servicer, health)
        await server.start()
        return servicer, server

    def stop(self) -> None:
        self._call(self.server.stop())
        self._call(self.servicer.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def gateway(tokenizer_dir):
    """(fake coordinator servicer, HTTP port)."""
    fake = FakeCoordinatorThread()
    fake.set_serving()
    gateway = InProcessHttpGateway(tokenizer_dir, fake.port)
    try:
        yield fake.servicer, gateway.port
    finally:
        gateway.stop()
        fake.stop()


@pytest.fixture
def fake(gateway, tokenizer):
    servicer, _ = gateway
    servicer.script, servicer.step_delay_s, servicer.error = [tokenizer.encode("ok", add_special_tokens=False)], 0.0, None
    return servicer


def _post(port: int, path: str, body: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read().decode()
        return response.status, json.loads(data) if data.startswith("{") else {"raw": data}
    finally:
        conn.close()


CHAT = [{"role": "user", "content": "hi"}]
UNSENDABLE = [  # (route, body, OpenAI param): each was a 500 (ValueError / UnicodeEncodeError in protobuf)
    ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("completions", {"prompt": "hi", "seed": 2**63}, "seed"),
    ("completions", {"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids[0]"),
    ("completions", {"prompt": [2**40]}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
    ("completions", {"prompt": "hi", "top_k": 2**40}, "top_k"),
    ("completions", {"prompt": "hi", "n": 2**40}, "n"),
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("completions", {"prompt": ["ok \udfff"]}, "prompt[0]"),
    ("completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop[0]"),
    ("completions", {"prompt": "hi", "stop": "\ud800"}, "stop"),
    ("completions", {"prompt": "hi", "model": "\ud800"}, "model"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages[0].content[0].text"),
    ("chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": CHAT, "seed": 2**64}, "seed"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 2**40}, "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
]


@pytest.mark.parametrize("route,body,param", UNSENDABLE, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(UNSENDABLE)])
def test_values_the_wire_cannot_carry_are_400_naming_the_param(gateway, fake, route, body, param):
    _, port = gateway
    status, response = _post(port, f"/v1/{route}", json.dumps(body))  # json.dumps escapes surrogates: valid JSON
    assert status == 400, response
    assert response["error"]["param"] == param and response["error"]["type"] == "invalid_request_error", response
    status, response = _post(port, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}))
    assert status == 200 and response["choices"][0]["text"] == "ok"  # the gateway keeps serving


@pytest.mark.parametrize("raw", ["{bad json", '{"prompt": "hi",}', '{"prompt": "hi"'])
def test_malformed_json_is_400_without_a_bogus_param(gateway, fake, raw):
    _, port = gateway
    status, response = _post(port, "/v1/completions", raw)
    assert status == 400 and response["error"]["param"] is None, response
    assert response["error"]["message"].startswith("body: "), response


def _send_and_drop(port: int, body: dict, num_requests_before: int, fake) -> str:
    """Sends ``body``, waits until the coordinator got the request, closes the socket; its id."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.monotonic() + 30
    while len(fake.requests) <= num_requests_before:
        assert time.monotonic() < deadline, "the request never reached the coordinator"
        time.sleep(0.01)
    sock.close()
    return fake.requests[-1].request_id


@pytest.mark.parametrize("is_stream", [False, True])
def test_client_disconnect_before_the_first_byte_aborts_at_the_coordinator(gateway, fake, is_stream):
    """The fake coordinator needs 0.2 s for a first chunk and 8 s for all 40: the client leaves
    after the request reached it, before any response byte was written."""
    _, port = gateway
    fake.script, fake.step_delay_s = [fake.script[0]] * 40, 0.2
    request_id = _send_and_drop(port, {"prompt": "hi", "max_tokens": 40, "stream": is_stream}, len(fake.requests), fake)
    deadline = time.monotonic() + ABORT_WAIT_S
    while request_id not in fake.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request_id in fake.aborted


@pytest.fixture(scope="module")
def prompt_tokenizer(tokenizer_dir) -> PromptTokenizer:
    return PromptTokenizer(tokenizer_dir)


@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_text_too_long_to_fit_is_refused_without_tokenizing(prompt_tokenizer, monkeypatch, kind):
    """Tokenizing runs on the gateway's event loop: a 10 MB prompt stalled every other stream for
    13 s. Text with more bytes than max_model_len tokens can span is refused before tokenizing."""
    cfg = GatewayConfig(tokenizer="unused", max_model_len=64)
    assert 4 <= prompt_tokenizer.max_token_bytes < 1000  # SmolLM2's longest token: 81 bytes
    max_bytes = cfg.max_model_len * prompt_tokenizer.max_token_bytes * PROMPT_BYTES_SLACK
    text = "a" * (max_bytes + 1)

    def never(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(prompt_tokenizer, "encode_text", never)
    monkeypatch.setattr(prompt_tokenizer, "encode_chat", never)
    request = (generate_pb2.GenerateRequest(prompt=text) if kind == "prompt" else generate_pb2.GenerateRequest(
        messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content=text)])))
    with pytest.raises(InvalidRequestError, match=f"^{kind}: {max_bytes + 1} bytes") as info:
        prepare_request(request, prompt_tokenizer, cfg)
    assert info.value.field == kind
    monkeypatch.undo()
    fits = generate_pb2.GenerateRequest(prompt="a" * 60)  # a short prompt still goes through the tokenizer
    assert len(prepare_request(fits, prompt_tokenizer, cfg).prompt_token_ids) < cfg.max_model_len


def test_a_wrong_method_is_a_client_error_not_an_internal_one(gateway):
    """Issue 25.6: 405 (GET on a POST route) was typed internal_error."""
    _, port = gateway
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v1/chat/completions")
        response = conn.getresponse()
        body = json.loads(response.read().decode())
    finally:
        conn.close()
    assert response.status == 405 and body["error"]["type"] == "invalid_request_error"
