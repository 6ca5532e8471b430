"""HTTP API edge cases: a real ``python -m gateway --http-port --api-key`` in front of the fake
coordinator of gateway_harness (scripted chunks, settable error and health).

Checked: /health follows the coordinator's health (503 -> 200); a wrong or missing API key is 401;
coordinator RESOURCE_EXHAUSTED / UNAVAILABLE become 429 / 503 (streaming too, before any event);
malformed bodies are 400 naming the field; usage carries the ``minedraft`` extension; a client
that drops an SSE stream aborts the request at the coordinator.
"""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time

import grpc
import openai
import pytest

from minedraft.v1 import common_pb2

from gateway_harness import FakeCoordinatorThread, _free_port, _wait_until_up

TEXT = "Hello world!"
API_KEY = "test-key"
MODEL = "tiny-http-model"


@pytest.fixture(scope="module")
def gateway(tokenizer_dir):
    """(fake coordinator servicer, http port); /health checked 503 before the coordinator serves."""
    fake = FakeCoordinatorThread()
    port, http_port = _free_port(), _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--tokenizer", tokenizer_dir, "--coordinator", f"127.0.0.1:{fake.port}",
         "--port", str(port), "--http-port", str(http_port), "--api-key", API_KEY, "--model-name", MODEL,
         "--max-model-len", "64", "--grace", "1"], stderr=subprocess.PIPE)
    try:
        _wait_until_up(port, process)
        assert _request(http_port, "GET", "/health")[0] == 503
        fake.set_serving()
        deadline = time.monotonic() + 30
        while _request(http_port, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, "gateway HTTP health never became 200"
            time.sleep(0.1)
        yield fake.servicer, http_port
    finally:
        process.terminate()
        process.wait(timeout=30)
        fake.stop()


def _request(port: int, method: str, path: str, body=None, key: str | None = API_KEY) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=body if isinstance(body, (str, type(None))) else json.dumps(body),
                     headers=headers)
        response = conn.getresponse()
        data = response.read().decode()
        is_json = response.getheader("content-type", "").startswith("application/json")
        return response.status, json.loads(data) if is_json else data
    finally:
        conn.close()


@pytest.fixture
def fake(gateway, tokenizer):  # noqa: F811
    servicer, _ = gateway
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    servicer.script, servicer.step_delay_s, servicer.error = [ids[:1], ids[1:]], 0.0, None
    yield servicer
    servicer.error = None


def test_api_key_is_required_on_v1_routes(gateway, fake):
    _, port = gateway
    for key in (None, "wrong"):
        status, body = _request(port, "GET", "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _request(port, "GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == MODEL and body["data"][0]["max_model_len"] == 64
    assert _request(port, "GET", "/health", key=None)[0] == 200  # health needs no key


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503)])
@pytest.mark.parametrize("is_stream", [False, True])
def test_coordinator_errors_map_to_http_status(gateway, fake, code, status, is_stream):
    _, port = gateway
    fake.error = common_pb2.GenerateError(code=code.value[0], message="coordinator says no")
    got, body = _request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": is_stream})
    assert got == status and body["error"]["message"] == "coordinator says no"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": -1.0}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": 1e308}, "repetition_penalty"),   # inf as the wire's float32
    ({"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 (= unset) as float32
])
def test_invalid_body_is_400_naming_the_param(gateway, fake, body, param):
    _, port = gateway
    status, response = _request(port, "POST", "/v1/completions", body)
    assert status == 400 and response["error"]["param"] == param, response
    assert response["error"]["type"] == "invalid_request_error"


def test_penalties_reach_the_coordinator_on_completions_and_chat(gateway, fake):
    _, port = gateway
    fake.script = [[5]]
    penalties = {"presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.5}
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})):
        status, _ = _request(port, "POST", route, {**body, "max_tokens": 1, **penalties})
        sampling = fake.requests[-1].sampling
        assert status == 200 and (sampling.presence_penalty, sampling.frequency_penalty,
                                  sampling.repetition_penalty) == (0.5, -1.25, 1.5)
    _request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert fake.requests[-1].sampling.repetition_penalty == 0.0    # unset on the wire: the engines read 1


def test_chat_params_are_named_as_sent(gateway, fake):
    _, port = gateway
    messages = [{"role": "user", "content": "hi"}]
    for body, param in (({"max_completion_tokens": 1000}, "max_completion_tokens"), ({"max_tokens": 1000}, "max_tokens"),
                        ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
                        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role")):
        status, response = _request(port, "POST", "/v1/chat/completions", {"messages": messages, **body})
        assert status == 400 and response["error"]["param"] == param, response


def test_usage_extension_and_stop_string(gateway, fake):
    _, port = gateway
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=6)
    assert response.choices[0].text == TEXT and response.choices[0].finish_reason == "length"
    num_tokens = response.usage.completion_tokens
    assert num_tokens == len(fake.script[0]) + len(fake.script[1]) and num_tokens >= 2
    extension = response.usage.model_extra["minedraft"]
    assert extension == {"num_draft_tokens": 3, "num_accepted_tokens": num_tokens - 2, "num_drafts": 1,
                         "mean_acceptance_length": 1 + (num_tokens - 2)}
    stopped = client.completions.create(model=MODEL, prompt="hi", max_tokens=6, stop="world")
    assert stopped.choices[0].text == "Hello " and stopped.choices[0].finish_reason == "stop"


def test_dropped_sse_stream_aborts_at_the_coordinator(gateway, fake):
    _, port = gateway
    fake.script, fake.step_delay_s = [[72]] * 40, 0.05
    num_aborted = len(fake.aborted)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}",
                                                          "Content-Type": "application/json"},
                 body=json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}))
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")
    conn.close()
    deadline = time.monotonic() + 10
    while len(fake.aborted) == num_aborted:
        assert time.monotonic() < deadline, "the dropped stream was not aborted"
        time.sleep(0.05)
