"""``n`` > 1 and ``best_of`` on a real ``psd`` stack (tiny random models, real processes; issue 25):
greedy n = 2 gives two choices equal to n = 1; seeded n = 3 is reproducible, its choices differ,
and choice i equals a single request with seed + i (each choice is its own request, sampled by
the engines); HTTP best_of returns the n choices with the highest cumulative logprob.
"""
from __future__ import annotations

import openai
import pytest
import torch

from minedraft.client import MineDraftClient

from test_openai_api import _openai, _start
from test_e2e_stack import model_dirs  # noqa: F401  (module fixture)

torch.set_num_threads(1)

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def psd(model_dirs, tmp_path_factory):  # noqa: F811
    stack = _start("psd", model_dirs, tmp_path_factory)
    yield stack
    stack.__exit__(None, None, None)


def _client(stack) -> MineDraftClient:
    return MineDraftClient(f"{stack.cfg.host}:{stack.cfg.gateway_port}", timeout_s=240)


def test_greedy_n2_equals_n1(psd):
    with _client(psd) as client:
        one = client.generate(messages=MESSAGES, max_tokens=16, temperature=0)
        two = client.generate_choices(messages=MESSAGES, max_tokens=16, temperature=0, n=2)
    assert [r.token_ids for r in two] == [one.token_ids] * 2 and one.token_ids


def test_seeded_n3_is_reproducible_differs_and_uses_seed_plus_i(psd):
    kwargs = dict(messages=MESSAGES, max_tokens=16, temperature=1.0, ignore_eos=True)
    with _client(psd) as client:
        first = client.generate_choices(**kwargs, seed=11, n=3)
        again = client.generate_choices(**kwargs, seed=11, n=3)
        single = client.generate(**kwargs, seed=13)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in first}) == 3
    assert first[2].token_ids == single.token_ids


def test_http_best_of_keeps_the_highest_cumulative_logprob(psd):
    client = _openai(psd)
    body = dict(model=None, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=5, logprobs=0,
                extra_body={"ignore_eos": True})
    best = client.completions.create(**body, n=2, best_of=4)
    samples = client.completions.create(**body, n=4)
    totals = sorted((sum(c.logprobs.token_logprobs) for c in samples.choices), reverse=True)
    assert [sum(c.logprobs.token_logprobs) for c in best.choices] == pytest.approx(totals[:2], abs=1e-4)
    assert [c.index for c in best.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body, best_of=2, stream=True)
    assert info.value.body["param"] == "best_of"
