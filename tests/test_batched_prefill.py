"""Batched prefill (``ModelConfig.max_prefill_tokens``): several prompts per forward give the
same first tokens, logprobs and later steps as one prompt per forward; all or nothing on errors."""

from __future__ import annotations

import pytest
import torch

from specdec.config import CUDA_MAX_PREFILL_TOKENS, CacheConfig, ModelConfig
from specdec.errors import CapacityError
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams
from specdec.engine.worker import DraftWorker, TargetWorker
from specdec.engine.worker_base import prefill_groups

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41], [1, 7, 100, 3, 3, 3, 90, 12], [2, 3], [9] * 11]


def _worker(tiny_llama, max_prefill_tokens: int, cls=TargetWorker, max_model_len=64, is_rowwise=True):
    """``is_rowwise=False``: the batched attention layout the CUDA dynamic path uses (CPU twin)."""
    model = tiny_llama(dtype=torch.float64)
    runner = ModelRunner(ModelConfig(dtype="float64", max_prefill_tokens=max_prefill_tokens),
                         CacheConfig(max_num_seqs=len(PROMPTS), max_model_len=max_model_len), model=model)
    runner.cache.is_rowwise = is_rowwise
    return cls(runner, seed=0) if cls is TargetWorker else cls(runner, target_vocab_size=160, seed=0)


def test_prefill_groups_pack_shortest_first_within_the_padded_budget():
    assert prefill_groups([5, 3, 8], 0) == [[1], [0], [2]]
    assert prefill_groups([5, 3, 8], 10) == [[1, 0], [2]]          # 2 x 5 = 10 fits, 3 x 8 does not
    assert prefill_groups([5, 3, 8], 24) == [[1, 0, 2]]
    assert prefill_groups([40, 3], 16) == [[1], [0]]                # longer than the budget: alone
    assert prefill_groups([], 16) == []
    assert sorted(i for g in prefill_groups([7, 1, 4, 4, 9, 2], 12) for i in g) == list(range(6))


def test_budget_resolves_by_device():
    assert ModelConfig().prefill_token_budget == 0
    assert ModelConfig(device="cuda:0").prefill_token_budget == CUDA_MAX_PREFILL_TOKENS
    assert ModelConfig(max_prefill_tokens=64).prefill_token_budget == 64
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        ModelConfig(max_prefill_tokens=-1)


@pytest.mark.parametrize("is_rowwise", [True, False])
@pytest.mark.parametrize("budget", [16, 1024])
def test_batched_target_prefill_equals_one_prompt_per_forward(tiny_llama, budget, is_rowwise):
    single, batched = _worker(tiny_llama, 0), _worker(tiny_llama, budget, is_rowwise=is_rowwise)
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    sampled = SamplingParams(temperature=1.0, seed=7, logprobs=3)
    items = [(r, p, sampled if i == 2 else GREEDY) for i, (r, p) in enumerate(zip(ids, PROMPTS))]
    expected = [single.add_request(*item) for item in items]
    got = batched.add_requests(items)
    for want, have in zip(expected, got):
        assert have.request_id == want.request_id and have.token_ids == want.token_ids
        assert have.logprobs == pytest.approx(want.logprobs, abs=1e-9)
        assert [t for t, _ in have.top_logprobs] == [t for t, _ in want.top_logprobs]
    for _ in range(4):   # the KV written by the batched prefill decodes the same continuation
        steps = [single.verify(ids, [[] for _ in ids], None), batched.verify(ids, [[] for _ in ids], None)]
        assert [s.token_ids for s in steps[0]] == [s.token_ids for s in steps[1]]


def test_batched_draft_prefill_drafts_the_same_tokens(tiny_llama):
    single, batched = _worker(tiny_llama, 0, DraftWorker), _worker(tiny_llama, 1024, DraftWorker)
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for r, p in zip(ids, PROMPTS):
        single.add_request(r, p, GREEDY)
    batched.add_requests([(r, p, GREEDY) for r, p in zip(ids, PROMPTS)])
    committed = [(len(p) - 1, [p[-1]]) for p in PROMPTS]
    assert single.draft(ids, committed, 3)[0] == batched.draft(ids, committed, 3)[0]


def test_a_failing_batch_adds_nothing_and_frees_every_slot(tiny_llama):
    worker = _worker(tiny_llama, 1024, max_model_len=16)
    items = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:3])] + [("long", [1] * 17, GREEDY)]
    with pytest.raises(CapacityError):
        worker.add_requests(items)
    assert worker.num_active == 0 and worker.runner.num_free_slots == len(PROMPTS)
    with pytest.raises(ValueError, match="already active or repeated"):
        worker.add_requests([("a", [1, 2], GREEDY), ("a", [3], GREEDY)])
    with pytest.raises(ValueError, match="non-empty"):
        worker.add_requests([("a", [1, 2], GREEDY), ("b", [], GREEDY)])
    assert worker.num_active == 0 and worker.runner.num_free_slots == len(PROMPTS)
    assert len(worker.add_requests(items[:3])) == 3 and worker.num_active == 3
