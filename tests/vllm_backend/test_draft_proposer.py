"""``VllmDraftWorker`` with ``proposer_tokens`` (``--draft-proposer``): vLLM's draft-model proposer
drafts tokens 2..k inside the call's one engine step (run in ``.venv-vllm``).

A tiny float32 Llama, ``enforce_eager``. Checked: greedy drafts equal the k-step drafter's and the
HF model's greedy continuation, ragged k_i included, in one engine step per call; k_i above
``proposer_tokens + 1`` still gets its k_i tokens (more steps); a sampled row's first token is
sampled and the rest are the greedy continuation of it, seeded rows repeat; every call's rows
leave the engine (no request, no KV block held); sessions refuse the proposer.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import _build_tiny_llama
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.draft import VllmDraftWorker
from specdec.vllm_backend.draft_sessions import VllmSessionDraftWorker
from specdec.vllm_backend.engine import VllmEngineConfig, scheduler_of

SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
VOCAB = 128
K = 4
GREEDY = SamplingParams(temperature=0.0, seed=0)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model dir, the HF model)."""
    hf = _build_tiny_llama(num_layers=2, seed=3, vocab_size=VOCAB, **SHAPE)
    path = str(tmp_path_factory.mktemp("draft"))
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _cfg(path: str, **kwargs) -> VllmEngineConfig:
    return VllmEngineConfig(model=path, max_num_seqs=16, max_model_len=256, enforce_eager=True,
                            kv_cache_space_gib=0.05, **kwargs)


@pytest.fixture(scope="module")
def plain(model):
    return VllmDraftWorker(_cfg(model[0]), seed=0)


@pytest.fixture(scope="module")
def proposer(model):
    return VllmDraftWorker(_cfg(model[0], proposer_tokens=K - 1), seed=0)


@pytest.fixture(scope="module")
def short_proposer(model):
    return VllmDraftWorker(_cfg(model[0], proposer_tokens=1), seed=0)


def _count_steps(worker, monkeypatch) -> list[int]:
    steps, step = [], worker.engine.engine_core.get_output
    monkeypatch.setattr(worker.engine.engine_core, "get_output", lambda: (steps.append(1), step())[1])
    return steps


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:] if n else []


def _free_blocks(worker) -> int:
    return scheduler_of(worker.engine).kv_cache_manager.block_pool.get_num_free_blocks()


def test_greedy_drafts_equal_the_k_step_drafters_in_one_engine_step(plain, proposer, model, monkeypatch):
    ids = [f"g{i}" for i in range(6)]
    seqs = {rid: _prompt(i, 20 + 9 * i) for i, rid in enumerate(ids)}
    ks = [4, 4, 3, 2, 1, 0]
    for worker in (plain, proposer):
        worker.add_requests([(rid, seqs[rid], GREEDY) for rid in ids])
    free = _free_blocks(proposer)
    steps = _count_steps(proposer, monkeypatch)
    try:
        committed = [(len(seqs[rid]), []) for rid in ids]
        for call in range(4):
            steps.clear()
            want, _ = plain.draft(ids, committed, ks)
            got, _ = proposer.draft(ids, committed, ks)
            assert got == want and [len(row) for row in got] == ks, call
            assert len(steps) == 1, (call, len(steps))   # k-step drafting took max(ks) = 4
            for rid, row in zip(ids, got):
                assert row == _hf_greedy(model[1], seqs[rid], len(row))
            # the verifier kept a prefix of each row's drafts and added one token of its own
            for i, (rid, row) in enumerate(zip(ids, got)):
                start = len(seqs[rid])
                seqs[rid] += row[:(call + i) % (len(row) + 1)] + [(7 * call + i) % VOCAB + 3]
                committed[i] = (start, seqs[rid][start:])
        assert not scheduler_of(proposer.engine).requests and not proposer.engine.output_processor.request_states
        assert _free_blocks(proposer) == free   # the rows cut short after their one step hold no KV block
    finally:
        for worker in (plain, proposer):
            for rid in ids:
                worker.release(rid)


def test_k_above_the_proposals_takes_more_steps_and_the_same_tokens(plain, short_proposer, monkeypatch):
    ids = ["s0", "s1"]
    seqs = {rid: _prompt(40 + i, 30 + i) for i, rid in enumerate(ids)}
    for worker in (plain, short_proposer):
        worker.add_requests([(rid, seqs[rid], GREEDY) for rid in ids])
    steps = _count_steps(short_proposer, monkeypatch)
    try:
        committed = [(len(seqs[rid]), []) for rid in ids]
        want, _ = plain.draft(ids, committed, [K, 2])
        got, _ = short_proposer.draft(ids, committed, [K, 2])
        assert got == want and [len(row) for row in got] == [K, 2]
        assert 1 < len(steps) < K   # vLLM's own speculative steps after the first: 2 tokens a step
    finally:
        for worker in (plain, short_proposer):
            for rid in ids:
                worker.release(rid)


def test_a_sampled_row_samples_its_first_token_and_continues_it_greedily(proposer, model):
    prompt = _prompt(60, 25)
    seeded = SamplingParams(temperature=1.5, seed=77)
    runs = []
    for name in ("x", "y"):
        proposer.add_requests([(name, prompt, seeded)])
        try:
            rows, _ = proposer.draft([name], [(len(prompt), [])], K)
            runs.append(rows[0])
        finally:
            proposer.release(name)
    assert runs[0] == runs[1]   # a seeded row repeats
    firsts = set()
    for seed in range(12):
        proposer.add_requests([("z", prompt, SamplingParams(temperature=1.5, seed=seed))])
        try:
            row = proposer.draft(["z"], [(len(prompt), [])], K)[0][0]
        finally:
            proposer.release("z")
        assert row[1:] == _hf_greedy(model[1], prompt + row[:1], K - 1)
        firsts.add(row[0])
    assert len(firsts) > 1   # the first token is sampled, not the argmax


def test_sessions_refuse_the_proposer(model):
    with pytest.raises(ValueError, match="proposer_tokens"):
        VllmSessionDraftWorker(dataclasses.replace(_cfg(model[0], proposer_tokens=2), enable_prefix_caching=False))


def test_the_config_asks_vllm_for_a_draft_model_proposer_of_the_engines_own_model():
    cfg = _cfg("/m", proposer_tokens=3)
    assert cfg.speculative_config() == {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
    assert cfg.batched_tokens == max(256, 16 * 4)   # a fallback step schedules each row's 3 proposals
    assert _cfg("/m").speculative_config() is None
    for bad, field in ((dict(proposer_tokens=-1), "proposer_tokens"),
                       (dict(proposer_tokens=2, num_speculative_tokens=2), "proposer_tokens"),
                       (dict(proposer_tokens=2, async_scheduling=True), "async_scheduling")):
        with pytest.raises(ValueError, match=field):
            _cfg("/m", **bad)


@pytest.mark.parametrize("case", ["near-max-model-len", "penalties"])
def test_calls_the_proposals_cannot_serve_run_as_speculative_steps_with_the_k_step_tokens(plain, proposer, monkeypatch,
                                                                                          case):
    """A row within ``proposer_tokens`` of ``max_model_len`` (vLLM's CPU build then proposes 0 for
    every row of the step) or with penalties (the proposer drafts the plain argmax): the call takes
    no proposals; its tokens equal k-step drafting's."""
    near = case == "near-max-model-len"
    other = SamplingParams(temperature=0.0, seed=0, repetition_penalty=1.0 if near else 1.3)
    rows = [("n0", _prompt(80, 254 if near else 30), other, 2), ("n1", _prompt(81, 20), GREEDY, K)]
    for worker in (plain, proposer):
        worker.add_requests([(rid, seq, params) for rid, seq, params, _ in rows])
    steps = _count_steps(proposer, monkeypatch)
    try:
        committed = [(len(seq), []) for _, seq, _, _ in rows]
        ks = [k for *_, k in rows]
        want, _ = plain.draft([r[0] for r in rows], committed, ks)
        got, _ = proposer.draft([r[0] for r in rows], committed, ks)
        assert got == want and [len(row) for row in got] == ks and 0 not in got[1][1:]
        assert len(steps) > 1   # vLLM's speculative steps: no proposals taken
    finally:
        for worker in (plain, proposer):
            for rid, *_ in rows:
                worker.release(rid)
