"""The OpenAI-compatible HTTP API and the gRPC client against real stacks (tiny models, real processes).

The official ``openai`` package talks to the gateway's HTTP port: chat and completions, streaming
and not, logprobs, errors in the OpenAI shape, /v1/models, /health, /metrics. Logprobs: at
temperature 0 the tokens, logprobs and top_logprobs of ``psd`` equal those of ``ar`` within 1e-4
(accepted, recovered and bonus tokens alike), ``sd`` likewise, and the logprobs equal log_softmax of a plain HF
forward of the target. The gRPC client (sync and async, streaming, abort) runs on the same stack.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from minedraft.client import AsyncMineDraftClient, MineDraftClient, build_request
from minedraft.launcher import Stack

from test_e2e_stack import _config, _free_ports, model_dirs  # noqa: F401  (module fixture)

torch.set_num_threads(1)

NUM_TOP = 3
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
PROMPT = "The capital of France is"
TOLERANCE = 1e-4


def _start(mode: str, model_dirs, tmp_path_factory, api_key: str = "") -> Stack:  # noqa: F811
    target, draft = model_dirs
    cfg = dataclasses.replace(_config(mode, target, draft, str(tmp_path_factory.mktemp("runs"))),
                              http_port=_free_ports(1)[0])
    stack = Stack(cfg)
    stack.__enter__()
    try:
        stack.start(target, log=lambda line: None)
    except BaseException:
        stack.__exit__(None, None, None)
        raise
    return stack


def _openai(stack: Stack, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{stack.cfg.host}:{stack.cfg.http_port}/v1", api_key=api_key,
                         timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def psd(model_dirs, tmp_path_factory):  # noqa: F811
    stack = _start("psd", model_dirs, tmp_path_factory)
    yield stack
    stack.__exit__(None, None, None)


@pytest.fixture(scope="module")
def ar_logprobs(model_dirs, tmp_path_factory):  # noqa: F811
    stack = _start("ar", model_dirs, tmp_path_factory)
    try:
        yield _chat_logprobs(_openai(stack)), _completion_logprobs(_openai(stack))
    finally:
        stack.__exit__(None, None, None)


def _chat_logprobs(client: openai.OpenAI):
    response = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=24, temperature=0,
                                              logprobs=True, top_logprobs=NUM_TOP)
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in response.choices[0].logprobs.content]


def _completion_logprobs(client: openai.OpenAI):
    response = client.completions.create(model=None, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=NUM_TOP,
                                         extra_body={"ignore_eos": True})
    lp = response.choices[0].logprobs
    return list(zip(lp.tokens, lp.token_logprobs, [sorted(t.items()) for t in lp.top_logprobs]))


def _assert_close(got, expected):
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, lp, top), (_, lp_ar, top_ar) in zip(got, expected):
        assert lp == pytest.approx(lp_ar, abs=TOLERANCE)
        assert [t for t, _ in top] == [t for t, _ in top_ar]
        assert [v for _, v in top] == pytest.approx([v for _, v in top_ar], abs=TOLERANCE)


def test_psd_logprobs_and_top_logprobs_equal_ar(psd, ar_logprobs, model_dirs):  # noqa: F811
    chat_ar, completion_ar = ar_logprobs
    chat, completion = _chat_logprobs(_openai(psd)), _completion_logprobs(_openai(psd))
    _assert_close(chat, chat_ar)
    _assert_close(completion, completion_ar)
    assert all(len(top) == NUM_TOP for _, _, top in chat)
    # the sampled token's logprob is the target's log_softmax of a plain HF forward
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
    model = AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32)
    with MineDraftClient(f"{psd.cfg.host}:{psd.cfg.gateway_port}", timeout_s=120) as client:
        result = client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=NUM_TOP)
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"] + result.token_ids
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)[len(ids) - len(result.token_ids) - 1: -1]
    expected = logprobs.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert result.logprobs == pytest.approx(expected.tolist(), abs=TOLERANCE)
    assert [t.token_ids[0] for t in result.top_logprobs] == logprobs.argmax(-1).tolist()
    assert result.usage.num_drafts > 0


def test_sd_logprobs_and_top_logprobs_equal_ar(ar_logprobs, model_dirs, tmp_path_factory):  # noqa: F811
    stack = _start("sd", model_dirs, tmp_path_factory)
    try:
        chat, completion = _chat_logprobs(_openai(stack)), _completion_logprobs(_openai(stack))
    finally:
        stack.__exit__(None, None, None)
    _assert_close(chat, ar_logprobs[0])
    _assert_close(completion, ar_logprobs[1])


def test_chat_and_completions_streaming_equal_non_streaming(psd):
    client = _openai(psd)
    chat = client.chat.completions.create(model=None, messages=MESSAGES, max_completion_tokens=16, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert chat.usage.model_extra["minedraft"]["num_draft_tokens"] > 0
    chunks = list(client.chat.completions.create(model=None, messages=MESSAGES, max_completion_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == chat.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    text = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0, seed=1)
    streamed = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert text.usage.completion_tokens == 16 or text.choices[0].finish_reason == "stop"


def test_errors_in_openai_shape(psd):
    client = _openai(psd)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=None, messages=MESSAGES, temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=None, prompt=PROMPT, n=17)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=None, prompt=[PROMPT, PROMPT])
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=None, messages=MESSAGES, logprobs=True, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"


def test_models_health_and_metrics(psd):
    models = _openai(psd).models.list().data
    assert [m.id for m in models] == [psd.cfg.target.rstrip("/").split("/")[-1]]
    base = f"http://{psd.cfg.host}:{psd.cfg.http_port}"
    with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        assert b"minedraft_gateway_http_requests_total" in response.read()
    request = urllib.request.Request(f"{base}/v1/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400 and "error" in json.loads(info.value.read())


def test_grpc_client_sync_async_stream_and_abort(psd):
    target = f"{psd.cfg.host}:{psd.cfg.gateway_port}"
    with MineDraftClient(target, timeout_s=120) as client:
        result = client.generate(messages=MESSAGES, max_tokens=12, temperature=0, logprobs=2)
        assert len(result.logprobs) == len(result.token_ids) == len(result.top_logprobs)
        assert "".join(client.stream_text(messages=MESSAGES, max_tokens=12, temperature=0)) == result.text
        stream = client.stream(build_request(PROMPT, request_id="client-abort", max_tokens=200,
                                             temperature=0, ignore_eos=True))
        assert next(stream).WhichOneof("response") == "chunk"
        assert client.abort("client-abort") is True
        assert [r.complete.finish_reason for r in stream if r.WhichOneof("response") == "complete"] == ["abort"]

    async def run_async():
        async with AsyncMineDraftClient(target, timeout_s=120) as aclient:
            deltas = [d async for d in aclient.stream_text(messages=MESSAGES, max_tokens=12, temperature=0)]
            return "".join(deltas), await aclient.generate(messages=MESSAGES, max_tokens=12, temperature=0)

    text, async_result = asyncio.run(run_async())
    assert text == async_result.text == result.text and async_result.token_ids == result.token_ids
