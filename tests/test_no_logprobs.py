"""``sampling.logprobs = -1`` (``NO_LOGPROBS``): a request that needs no logprobs gets none, and
the engines compute none (vLLM's ``logprobs=None``; the OpenAI API asks it for every request
without ``logprobs``, as vLLM's server does). Checked: the HTTP bodies' mapping, the gateway's
validation, ``SamplingParams``, the native target worker (same tokens, empty logprobs) and the
vLLM backend's output conversion (its engine: ``tests/vllm_backend/test_multi_step_decode.py``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gateway.config import GatewayConfig
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, chat_to_generate, completion_to_generate
from gateway.validation import NO_LOGPROBS, InvalidRequestError, prepare_request
from minedraft.v1 import common_pb2, generate_pb2
from specdec.config import CacheConfig, ModelConfig
from specdec.engine.runner import ModelRunner
from specdec.engine.worker import TargetWorker
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.outputs import step_output

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, expected", [
    ({}, NO_LOGPROBS), ({"logprobs": False}, NO_LOGPROBS), ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 3}, 3), ({"n": 2}, NO_LOGPROBS)])
def test_chat_asks_no_logprobs_unless_the_client_does(body, expected) -> None:
    request = chat_to_generate(ChatCompletionRequest(messages=CHAT, **body), "r")
    assert request.sampling.logprobs == expected


@pytest.mark.parametrize("body, expected", [
    ({}, NO_LOGPROBS), ({"logprobs": 0}, 0), ({"logprobs": 2}, 2), ({"n": 2}, NO_LOGPROBS),
    ({"best_of": 3}, 0), ({"n": 2, "best_of": 2}, NO_LOGPROBS), ({"n": 2, "best_of": 3, "logprobs": 1}, 1)])
def test_completions_ask_no_logprobs_unless_asked_or_best_of_ranks(body, expected) -> None:
    request = completion_to_generate(CompletionRequest(prompt="hi", **body), "r")
    assert request.sampling.logprobs == expected


@pytest.mark.parametrize("to_generate, body, field", [
    (completion_to_generate, CompletionRequest(prompt="hi", logprobs=-1), "logprobs"),
    (completion_to_generate, CompletionRequest(prompt="hi", logprobs=21), "logprobs"),
    (chat_to_generate, ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=-1), "top_logprobs"),
    (chat_to_generate, ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=21), "top_logprobs")])
def test_http_bodies_cannot_send_minus_one_themselves(to_generate, body, field) -> None:
    with pytest.raises(InvalidRequestError) as info:
        to_generate(body, "r")
    assert info.value.field == field and "[0, 20]" in str(info.value)


class _Tokenizer:
    vocab_size = 100

    def encode(self, text: str) -> list[int]:
        return [1, 2, 3]

    def encode_text(self, text: str) -> list[int]:
        return [1, 2, 3]


def _prepare(logprobs: int, n: int = 1, best_of: int = 0):
    request = generate_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1, 2]), n=n, best_of=best_of,
                                           sampling=common_pb2.SamplingParams(max_tokens=4, logprobs=logprobs))
    return prepare_request(request, _Tokenizer(), GatewayConfig(tokenizer="unused", max_n=4, max_model_len=64))


def test_the_gateway_passes_minus_one_and_refuses_below_it_or_with_best_of_ranking() -> None:
    assert _prepare(NO_LOGPROBS).sampling.logprobs == NO_LOGPROBS
    assert _prepare(NO_LOGPROBS, n=2).sampling.logprobs == NO_LOGPROBS
    for bad in ({"logprobs": -2}, {"logprobs": NO_LOGPROBS, "best_of": 3}):
        with pytest.raises(InvalidRequestError) as info:
            _prepare(**bad)
        assert info.value.field == "sampling.logprobs"


def test_sampling_params_take_minus_one_only() -> None:
    assert SamplingParams(logprobs=NO_LOGPROBS).logprobs == NO_LOGPROBS
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)


def test_the_native_target_commits_the_same_tokens_without_logprobs(tiny_llama) -> None:
    model = tiny_llama(dtype=torch.float64)
    runs = {}
    for logprobs in (0, NO_LOGPROBS):
        worker = TargetWorker(ModelRunner(ModelConfig(dtype="float64"), CacheConfig(max_num_seqs=2, max_model_len=64),
                                          model=model))
        params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=logprobs)
        outs = [worker.add_requests([("a", [1, 5, 9, 13], params)])[0]]
        outs += [worker.verify(["a"], [[7, 8]], None)[0], worker.verify(["a"], [[]], None)[0]]
        runs[logprobs] = outs
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[NO_LOGPROBS]]
    assert all(len(o.logprobs) == len(o.token_ids) for o in runs[0])
    assert all(o.logprobs == [] and o.top_logprobs == [] for o in runs[NO_LOGPROBS])


def test_the_vllm_backend_converts_an_output_without_logprobs() -> None:
    out = step_output("a", SimpleNamespace(token_ids=[4, 5, 6], logprobs=None), 2, NO_LOGPROBS)
    assert (out.token_ids, out.num_accepted, out.logprobs, out.top_logprobs) == ([4, 5, 6], 2, [], [])
    chosen = SimpleNamespace(logprob=-0.5, rank=1)
    out = step_output("a", SimpleNamespace(token_ids=[4], logprobs=[{4: chosen}]), 0, 0)
    assert out.logprobs == [-0.5] and out.top_logprobs == []
