"""The vLLM backend's invariants on real in-process vLLM engines (run in ``.venv-vllm``).

Tiny float32 Llamas (head_dim 64: vLLM's CPU attention needs >= 32), ``enforce_eager``, one
target and one draft engine per module. Checked: ``PsdScheduler`` runs only the named batch
(paused requests keep their KV, tokens and blocks; interleaved batches each equal their greedy
reference), the coordinator's drafts reach vLLM exactly (ragged k_i), a stray waiting request
and a too-small KV cache are refused, greedy verification is exact for any draft, seeded
sampling repeats whatever shares the batch, sampled speculative decoding with a different
draft model reproduces the target's exact distribution (chi-square), penalised greedy verification
counts the earlier drafts as output (vLLM's penalties under speculation), release frees the KV, and
``VllmDraftWorker``'s catch-up (k engine steps per call), capacity and unknown-id contracts.
"""
from __future__ import annotations


import copy
import types

import pytest
import torch

from conftest import _build_tiny_llama
from specdec.errors import CapacityError
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.draft import (CATCH_UP_NEW_TOKENS, MAX_DRAFT_GRAPH_TOKENS, VllmDraftWorker,
                                         drafting_config)
from specdec.vllm_backend.engine import VllmEngineConfig, build_engine, check_kv_capacity, to_vllm_sampling
from specdec.vllm_backend.target import VllmTargetWorker
from specdec.engine.worker_base import DraftCapacityError

SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
VOCAB = 128
K = 4
MAX_LEN = 256
GREEDY = SamplingParams(temperature=0.0, seed=0)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target dir, draft dir, HF target): the draft is the target with a little noise on every weight."""
    target = _build_tiny_llama(num_layers=2, seed=0, **SHAPE)
    draft = _build_tiny_llama(num_layers=2, seed=0, **SHAPE)
    torch.manual_seed(7)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.01 * torch.randn_like(param))
    dirs = [str(tmp_path_factory.mktemp(name)) for name in ("target", "draft")]
    target.save_pretrained(dirs[0], safe_serialization=True)
    draft.save_pretrained(dirs[1], safe_serialization=True)
    return dirs[0], dirs[1], target


def _cfg(model: str, **kwargs) -> VllmEngineConfig:
    return VllmEngineConfig(**{"model": model, "max_num_seqs": 32, "max_model_len": MAX_LEN, "enforce_eager": True,
                               "kv_cache_space_gib": 0.05, **kwargs})


@pytest.fixture(scope="module")
def target(models):
    return VllmTargetWorker(_cfg(models[0], num_speculative_tokens=K))


@pytest.fixture(scope="module")
def drafter(models):
    return VllmDraftWorker(_cfg(models[1]), seed=0)


@pytest.fixture(scope="module")
def fresh_drafter(models):
    """A second draft engine (module-scoped: a collected engine tears down vLLM's process-wide groups)."""
    return VllmDraftWorker(_cfg(models[1], max_num_seqs=2), seed=0)


def _vid(worker, rid: str) -> str:
    return worker._requests[rid].vllm_id


def _snapshot(worker, rid: str):
    request = worker.scheduler.requests[_vid(worker, rid)]
    blocks = worker.scheduler.kv_cache_manager.get_block_ids(_vid(worker, rid))
    return request.num_computed_tokens, list(request.output_token_ids), [list(b) for b in blocks]


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _drafts(ref: list[int], pos: int, num_correct: int, k: int = K) -> list[int]:
    """k drafts for output position ``pos``: the reference's next ``num_correct`` tokens, then wrong ones."""
    return ref[pos:pos + num_correct] + [(t + 1) % VOCAB for t in ref[pos + num_correct:pos + k]]


def test_verify_leaves_requests_outside_the_named_batch_untouched(target):
    target.add_requests([("only-a", _prompt(1, 126), GREEDY), ("only-b", _prompt(2, 40), GREEDY)])
    try:
        before_a, before_b = _snapshot(target, "only-a"), _snapshot(target, "only-b")
        for _ in range(3):
            target.verify(["only-a"], [[5, 6, 7]])
        after_a = _snapshot(target, "only-a")
        assert after_a[0] > before_a[0] and len(after_a[1]) >= len(before_a[1]) + 3
        assert len(after_a[2][0]) > len(before_a[2][0])        # a crossed a block boundary
        assert _snapshot(target, "only-b") == before_b
    finally:
        target.release("only-a"), target.release("only-b")


def test_interleaved_batches_each_equal_their_greedy_reference(target, models):
    shared = _prompt(3, 128)                                    # one full cached block, shared
    prompts = {"mix-a": shared + _prompt(4, 7), "mix-b": shared + _prompt(5, 12)}
    refs = {rid: _hf_greedy(models[2], p, 48) for rid, p in prompts.items()}
    out = {}
    for rid, prompt in prompts.items():                         # apart: b hits a's cached block
        out[rid] = target.add_requests([(rid, prompt, GREEDY)])[0].token_ids
    try:
        assert _snapshot(target, "mix-a")[2][0][0] == _snapshot(target, "mix-b")[2][0][0]
        for step in range(40):
            rid = "mix-a" if step % 3 else "mix-b"
            ref, pos = refs[rid], len(out[rid])
            if pos + K >= len(ref):
                continue
            drafts = _drafts(ref, pos, step % (K + 1)) if rid == "mix-a" else []
            out[rid] += target.verify([rid], [drafts])[0].token_ids
        assert len(out["mix-a"]) > 30 and len(out["mix-b"]) > 10
        for rid in prompts:
            assert out[rid] == refs[rid][:len(out[rid])], rid
    finally:
        target.release("mix-a"), target.release("mix-b")


def test_prefills_split_over_steps_after_prefix_cache_hits_sample_one_token(target, models):
    """Prompts whose cached prefix vLLM finds inside ``schedule``: those done in the first step
    stay paused while the rest finish (the step counter must count the hits), so each add
    returns exactly its first token and verification goes on from it."""
    block = target.engine.vllm_config.cache_config.block_size
    shared = _prompt(30, block)
    target.add_requests([("warm", shared + [3], GREEDY)]), target.release("warm")   # caches the block
    ids = [f"hit-{i}" for i in range(6)]
    prompts = {rid: shared + _prompt(31 + i, 60) for i, rid in enumerate(ids)}   # 6 x 60 new > one step
    assert 6 * 60 > target.cfg.batched_tokens
    refs = {rid: _hf_greedy(models[2], p, K + 2) for rid, p in prompts.items()}
    firsts = target.add_requests([(rid, prompts[rid], GREEDY) for rid in ids])
    try:
        assert [o.token_ids for o in firsts] == [refs[rid][:1] for rid in ids]
        out = target.verify(ids, [refs[rid][1:1 + K] for rid in ids])
        assert [o.num_accepted for o in out] == [K] * 6
        assert [o.token_ids for o in out] == [refs[rid][1:K + 2] for rid in ids]
    finally:
        for rid in ids:
            target.release(rid)


def test_wrong_drafts_accept_exactly_the_correct_prefix_and_equal_ar(target, models):
    prompt = _prompt(6, 20)
    ref = _hf_greedy(models[2], prompt, 60)
    out = target.add_requests([("ar-ref", prompt, GREEDY)])[0].token_ids
    for _ in range(10):                                         # ar on the same engine
        out += target.verify(["ar-ref"], [[]])[0].token_ids
    target.release("ar-ref")
    assert out == ref[:11]
    out = target.add_requests([("exact", prompt, GREEDY)])[0].token_ids
    try:
        for step in range(12):
            num_correct = step % (K + 1)
            result = target.verify(["exact"], [_drafts(ref, len(out), num_correct)])[0]
            assert result.num_accepted == num_correct
            assert result.token_ids == ref[len(out):len(out) + num_correct + 1]
            out += result.token_ids
    finally:
        target.release("exact")


def test_scheduled_drafts_are_exactly_the_given_ragged_rows(target, monkeypatch):
    ids = ["rag-a", "rag-b", "rag-c", "rag-d", "rag-paused"]
    target.add_requests([(rid, _prompt(10 + i, 5 + 3 * i), GREEDY) for i, rid in enumerate(ids)])
    seen = []
    schedule = target.scheduler.schedule

    def spy(*args, **kwargs):
        output = schedule(*args, **kwargs)
        seen.append((copy.deepcopy(output.scheduled_spec_decode_tokens), dict(output.num_scheduled_tokens)))
        return output

    monkeypatch.setattr(target.scheduler, "schedule", spy)
    rows = [[9, 8, 7, 6], [], [11], [12, 13]]
    try:
        results = target.verify(ids[:4], rows)
        assert len(seen) == 1
        spec, num_tokens = seen[0]
        assert spec == {_vid(target, rid): row for rid, row in zip(ids, rows) if row}
        assert num_tokens == {_vid(target, rid): len(row) + 1 for rid, row in zip(ids, rows)}
        assert [len(r.token_ids) for r in results] == [r.num_accepted + 1 for r in results]
        assert all(r.num_accepted <= len(row) for r, row in zip(results, rows))
    finally:
        for rid in ids:
            target.release(rid)


def test_waiting_request_outside_the_step_is_refused(target):
    vllm_id = target.engine.add_request("stray", {"prompt_token_ids": [3, 4, 5]}, to_vllm_sampling(GREEDY, 8))
    try:
        with pytest.raises(RuntimeError, match="waiting requests outside the scheduled batch"):
            target.engine.step()                                # the worker's idle step names nobody
    finally:
        target.engine.abort_request([vllm_id], internal=True)
    assert vllm_id not in target.scheduler.requests
    assert len(target.add_requests([("after-stray", [3, 4, 5], GREEDY)])[0].token_ids) == 1
    target.release("after-stray")


def test_release_frees_the_kv_blocks(target):
    pool = target.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    target.add_requests([("rel-a", _prompt(20, 200), GREEDY), ("rel-b", _prompt(21, 60), GREEDY)])
    target.verify(["rel-a", "rel-b"], [[3, 4, 5], []])
    vllm_ids = [_vid(target, "rel-a"), _vid(target, "rel-b")]
    assert pool.get_num_free_blocks() <= free - 3
    target.release("rel-a"), target.release("rel-b")
    assert not set(vllm_ids) & set(target.scheduler.requests)
    assert pool.get_num_free_blocks() == free and target.facts().num_free_slots == 32
    with pytest.raises(KeyError):
        target.release("rel-a")


def test_a_refused_request_takes_the_others_of_its_add_call_back_out(target, monkeypatch):
    """All or nothing: when vLLM refuses the second request of one add call, the first one is
    aborted again (no vLLM request, no KV block, no slot is left behind)."""
    pool = target.scheduler.kv_cache_manager.block_pool
    free, num_requests = pool.get_num_free_blocks(), len(target.scheduler.requests)
    real_add = target.engine.add_request
    calls = []

    def refuse_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise ValueError("refused by vLLM")
        return real_add(*args, **kwargs)

    monkeypatch.setattr(target.engine, "add_request", refuse_second)
    with pytest.raises(ValueError, match="refused by vLLM"):
        target.add_requests([("all-a", _prompt(30, 40), GREEDY), ("all-b", _prompt(31, 40), GREEDY)])
    monkeypatch.undo()
    assert calls == ["all-a", "all-b"]
    target.add_requests([("all-c", _prompt(32, 8), GREEDY)])   # steps the engine: an abort is applied
    target.release("all-c")
    assert len(target.scheduler.requests) == num_requests and pool.get_num_free_blocks() == free
    assert "all-a" not in target.request_ids and target.facts().num_free_slots == 32


@pytest.mark.parametrize("params, name", [(SamplingParams(temperature=2.5, seed=1), "temperature"),
                                          (SamplingParams(temperature=1.0, min_p=0.1, seed=1), "min_p")])
def test_parameters_vllm_refuses_are_value_errors_naming_them(target, drafter, params, name):
    """vLLM refuses temperature > 2 and min_p with speculation: ValueError (the services answer
    INVALID_ARGUMENT for that request, not INTERNAL) with vLLM's message; nothing stays behind."""
    num_requests = len(target.scheduler.requests)
    with pytest.raises(ValueError, match=name):
        target.add_requests([("refused", _prompt(40, 10), params)])
    if name == "temperature":
        with pytest.raises(ValueError, match="temperature"):
            drafter.add_requests([("refused-d", _prompt(40, 10), params)])
    else:   # the draft engine does not speculate: min_p is fine there
        drafter.add_requests([("refused-d", _prompt(40, 10), params)])
        drafter.release("refused-d")
    assert len(target.scheduler.requests) == num_requests and "refused" not in target.request_ids


def _sample_run(target, drafter, batch: dict[str, SamplingParams], prompt: list[int], steps: int) -> dict:
    """Speculative decoding of ``batch`` (same prompt) with drafts of k=3: {id: output tokens}."""
    items = [(rid, prompt, params) for rid, params in batch.items()]
    out = {o.request_id: list(o.token_ids) for o in target.add_requests(items)}
    drafter.add_requests(items)
    try:
        for _ in range(steps):
            drafts, _ = drafter.draft(list(out), [(len(prompt), out[rid]) for rid in out], 3)
            for result in target.verify(list(out), drafts):
                out[result.request_id] += result.token_ids
    finally:
        for rid in batch:
            target.release(rid), drafter.release(rid)
    return out


def test_seeded_sampling_repeats_alone_and_in_a_mixed_batch(target, drafter, models):
    prompt, seeded = _prompt(30, 9), SamplingParams(temperature=1.0, seed=1234)
    alone = [_sample_run(target, drafter, {"seed-x": seeded}, prompt, 6)["seed-x"] for _ in range(2)]
    mixed = _sample_run(target, drafter, {
        "seed-y": SamplingParams(temperature=1.0, top_k=5, seed=1), "seed-x": seeded, "seed-greedy": GREEDY,
        "seed-z": SamplingParams(temperature=1.0, top_p=0.8, seed=2),
        "seed-w": SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=3)}, prompt, 6)
    other = _sample_run(target, drafter, {"seed-x": SamplingParams(temperature=1.0, seed=99)}, prompt, 6)["seed-x"]
    assert len(alone[0]) >= 7
    assert alone[0] == alone[1] == mixed["seed-x"]
    assert other[:7] != alone[0][:7]
    greedy = mixed["seed-greedy"]                               # a greedy row among sampled ones stays exact
    assert greedy == _hf_greedy(models[2], prompt, len(greedy))


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square (counts vs probs); 0 when a count falls on a zero-probability cell."""
    expected = probs * counts.sum()
    if bool(((expected == 0) & (counts > 0)).any()):
        return 0.0
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@torch.no_grad()
def _top4(model, ids: list[int]) -> dict[int, float]:
    logits = model(torch.tensor([ids])).logits[0, -1].double()
    values, tokens = logits.topk(5)
    assert float(values[3] - values[4]) > 1e-3                  # the top-4 set is unambiguous
    return dict(zip(tokens[:4].tolist(), torch.softmax(values[:4], 0).tolist()))


def test_sampled_speculative_pairs_follow_the_exact_target_distribution(target, drafter, models):
    prompt = _prompt(40, 6)
    counts: dict[tuple[int, int], int] = {}
    num_accepted = []
    for round_ in range(64):                                   # 2048 samples
        batch = {f"dist-{round_}-{i}": SamplingParams(temperature=1.0, top_k=4, seed=1000 * round_ + i)
                 for i in range(32)}
        items = [(rid, prompt, p) for rid, p in batch.items()]
        first = {o.request_id: o.token_ids[0] for o in target.add_requests(items)}
        drafter.add_requests(items)
        try:
            ids = list(batch)
            drafts, _ = drafter.draft(ids, [(len(prompt), [first[rid]]) for rid in ids], 2)
            for rid, result in zip(ids, target.verify(ids, drafts)):
                pair = (first[rid], result.token_ids[0])
                counts[pair] = counts.get(pair, 0) + 1
                num_accepted.append(result.num_accepted)
        finally:
            for rid in batch:
                target.release(rid), drafter.release(rid)
    p0 = _top4(models[2], prompt)
    exact = {(t0, t1): p * q for t0, p in p0.items() for t1, q in _top4(models[2], prompt + [t0]).items()}
    cells = sorted(set(exact) | set(counts))

    def column(table: dict) -> torch.Tensor:
        return torch.tensor([float(table.get(c, 0)) for c in cells], dtype=torch.float64)

    assert min(num_accepted.count(0), len(num_accepted) - num_accepted.count(0)) > 0.1 * len(num_accepted)
    assert _chi_square_p(column(counts), column(exact)) > 1e-3
    # The test has power: t1 conditioned on a wrong t0 (the next one of the top 4) is rejected.
    shift = dict(zip(p0, list(p0)[1:] + list(p0)[:1]))
    wrong = {(t0, t1): p * q for t0, p in p0.items() for t1, q in _top4(models[2], prompt + [shift[t0]]).items()}
    assert _chi_square_p(column(counts), column(wrong)) < 1e-6


def test_draft_catch_up_after_partial_acceptance_drafts_from_the_committed_sequence(drafter, fresh_drafter):
    prompt, fresh = _prompt(50, 30), fresh_drafter
    drafter.add_requests([("catch", prompt, GREEDY)])
    try:
        first, _ = drafter.draft(["catch"], [(len(prompt), [5])], 3)
        committed = [5, first[0][0], (first[0][1] + 1) % VOCAB]   # d0 accepted, d1 replaced
        again, _ = drafter.draft(["catch"], [(len(prompt) + 1, committed[1:])], 3)
        fresh.add_requests([("ref", prompt + committed, GREEDY)])
        expected, _ = fresh.draft(["ref"], [(len(prompt) + 3, [])], 3)
        assert again == expected and len(again[0]) == 3
        stale, _ = fresh.draft(["ref"], [(len(prompt) + 1, first[0][:2])], 3)   # from the drafted tokens
        assert again != stale
    finally:
        drafter.release("catch"), fresh.release("ref")


def test_draft_calls_take_k_engine_steps_while_every_row_catches_up(drafter, monkeypatch):
    """24 rows, each committing 1-5 tokens per call after the uncached tail of its last KV block:
    every call's catch-ups fit its first engine step, so a call of k = 4 takes 4 steps (with
    vLLM's CPU default, 128-token blocks in a 256-token step budget, it took 11)."""
    cache, sched = drafter.engine.vllm_config.cache_config, drafter.engine.vllm_config.scheduler_config
    assert cache.block_size == 32 and sched.max_num_batched_tokens == 32 * (32 + CATCH_UP_NEW_TOKENS)
    ids = [f"steps{i}" for i in range(24)]
    seqs = {rid: _prompt(70 + i, 40 + 3 * i) for i, rid in enumerate(ids)}
    drafter.add_requests([(rid, seqs[rid], GREEDY) for rid in ids])
    num_steps, step = [], drafter.engine.engine_core.get_output
    monkeypatch.setattr(drafter.engine.engine_core, "get_output", lambda: (num_steps.append(1), step())[1])   # engine steps
    drafter.call_stats.calls.clear()
    try:
        for call in range(3):
            committed = []
            for i, rid in enumerate(ids):
                start = len(seqs[rid])
                seqs[rid] += _prompt(100 * call + i, 1 + (i + call) % 5)
                committed.append((start, seqs[rid][start:]))
            num_steps.clear()
            rows, _ = drafter.draft(ids, committed, K)
            assert [len(row) for row in rows] == [K] * len(ids) and len(num_steps) == K, (call, len(num_steps))
        # the service's per-call split (specdec.vllm_backend.call_stats): the admissions are not draft calls
        assert [(c.rows, len(c.later_ms)) for c in drafter.call_stats.calls] == [(24, K - 1)] * 3
        assert all(c.admit_ms > 0 and c.total_ms >= c.admit_ms + c.first_step_ms + sum(c.later_ms)
                   for c in drafter.call_stats.calls)
        # each call's requests ended in the engine core; none stays in vLLM's output processor (core_step)
        assert not drafter.engine.output_processor.request_states
    finally:
        for rid in ids:
            drafter.release(rid)


def test_drafting_config_fills_block_size_step_budget_and_graph_sizes_only_where_left_open(models):
    cpu = drafting_config(_cfg(models[1], max_num_seqs=64))
    assert cpu.block_size == 32 and cpu.max_num_batched_tokens == 64 * (32 + CATCH_UP_NEW_TOKENS)
    assert cpu.max_cudagraph_capture_size is None and cpu.compilation_config() == {}   # no CUDA graphs on CPU
    cuda = drafting_config(_cfg(models[1], device="cuda", max_num_seqs=4, max_model_len=2048))
    assert cuda.block_size is None and cuda.max_num_batched_tokens == 2048   # vLLM's 16; max_model_len is more
    assert cuda.compilation_config() == {"max_cudagraph_capture_size": 4 * (16 + CATCH_UP_NEW_TOKENS),
                                         "cudagraph_mode": "FULL"}
    wide = drafting_config(_cfg(models[1], device="cuda", max_num_seqs=256, max_model_len=2048))
    assert wide.max_num_batched_tokens == 256 * (16 + CATCH_UP_NEW_TOKENS)
    assert wide.max_cudagraph_capture_size == MAX_DRAFT_GRAPH_TOKENS   # start-up captures a graph per size
    mine = drafting_config(_cfg(models[1], block_size=64, max_num_batched_tokens=100))
    assert (mine.block_size, mine.max_num_batched_tokens) == (64, 100)
    mine = drafting_config(_cfg(models[1], device="cuda", max_cudagraph_capture_size=8, cudagraph_mode="PIECEWISE"))
    assert mine.compilation_config() == {"max_cudagraph_capture_size": 8, "cudagraph_mode": "PIECEWISE"}
    for bad in ({"block_size": 0}, {"max_cudagraph_capture_size": 0}, {"cudagraph_mode": "full"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            VllmEngineConfig(model=models[1], **bad)


def test_draft_capacity_error_changes_nothing_and_unknown_ids_raise(drafter):
    prompt = _prompt(60, 200)
    drafter.add_requests([("cap", prompt, GREEDY)])
    try:
        fits, _ = drafter.draft(["cap"], [(len(prompt), [7] * 52)], 4)   # 200 + 52 + 4 = 256: fits
        with pytest.raises(DraftCapacityError) as info:
            drafter.draft(["cap"], [(len(prompt), [8] * 53)], 4)
        assert info.value.request_ids == ["cap"]
        with pytest.raises(ValueError, match="outside the known committed length 252"):   # still 200 + 52 known
            drafter.draft(["cap"], [(len(prompt) + 53, [])], 1)
        assert drafter.draft(["cap"], [(len(prompt) + 52, [])], 4)[0] == fits   # ... and they are the 7s
        with pytest.raises(KeyError):
            drafter.draft(["cap", "nobody"], [(len(prompt), []), (0, [3])], 1)
        with pytest.raises(KeyError):
            drafter.release("nobody")
    finally:
        drafter.release("cap")


PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.6, repetition_penalty=1.8)


@torch.no_grad()
def _hf_greedy_penalised(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of the HF model with vLLM's penalty definitions (specdec.sample.penalties)."""
    from specdec.sample.penalties import apply_penalties

    ids, params = list(prompt), SamplingParams(temperature=0.0, **PENALTIES)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[:, -1:].double()
        ids.append(int(apply_penalties(logits, [params], [(prompt, ids[len(prompt):])])[0, 0].argmax()))
    return ids[len(prompt):]


def test_penalised_greedy_verify_counts_the_drafts_before_each_position(target, models):
    """vLLM's penalties under speculation: a draft position's history includes the earlier drafts,
    so drafts equal to the penalised greedy reference are all accepted, and ar equals it too."""
    prompt, params = _prompt(50, 12), SamplingParams(temperature=0.0, seed=0, **PENALTIES)
    ref = _hf_greedy_penalised(models[2], prompt, 40)
    assert ref != _hf_greedy(models[2], prompt, 40)
    out = target.add_requests([("pen-ar", prompt, params)])[0].token_ids
    for _ in range(10):
        out += target.verify(["pen-ar"], [[]])[0].token_ids
    target.release("pen-ar")
    assert out == ref[:11]
    out = target.add_requests([("pen-sd", prompt, params)])[0].token_ids
    try:
        for step in range(8):
            num_correct = K if step % 2 == 0 else step % K
            result = target.verify(["pen-sd"], [_drafts(ref, len(out), num_correct)])[0]
            assert result.num_accepted == num_correct
            assert result.token_ids == ref[len(out):len(out) + num_correct + 1]
            out += result.token_ids
    finally:
        target.release("pen-sd")


def test_kv_cache_below_max_num_seqs_times_max_model_len_is_refused(models):
    cfg = _cfg(models[0], max_num_seqs=16, num_speculative_tokens=K)   # 16 x 3 blocks of 128 (256 + k tokens)
    fake = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=128, num_gpu_blocks=16 * 3)))
    check_kv_capacity(fake, cfg)
    fake.vllm_config.cache_config.num_gpu_blocks = 16 * 3 - 1
    with pytest.raises(CapacityError):
        check_kv_capacity(fake, cfg)
    with pytest.raises(CapacityError, match="max_num_seqs=64"):  # 1 MiB of KV holds 1024 tokens, not 64 x 256
        build_engine(VllmEngineConfig(model=models[0], max_num_seqs=64, max_model_len=MAX_LEN, enforce_eager=True,
                                      kv_cache_space_gib=1 / 1024))



def test_request_params_are_dedicated_so_vllms_input_processing_skips_their_deep_copy(monkeypatch):
    first, second = to_vllm_sampling(GREEDY, 4), to_vllm_sampling(GREEDY, 4)
    assert first is not second and first.skip_clone and second.skip_clone
    deep_copies = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda *a, **kw: deep_copies.append(a) or real_deepcopy(*a, **kw))
    clone = first.clone()   # what vLLM's InputProcessor.process_inputs calls per request
    assert deep_copies == [] and clone.max_tokens == 4 and clone.temperature == 0.0
