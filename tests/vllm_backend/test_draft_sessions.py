"""``VllmSessionDraftWorker`` (resident draft sessions) on vLLM's CPU build (run in ``.venv-vllm``).

A tiny float32 Llama draft, ``enforce_eager``. Checked: after any verify outcome (drafts accepted,
replaced, rejected, none drafted, nothing new committed) the drafts are the draft model's greedy
continuation of the committed sequence (Hugging Face reference); a call re-admits no row and takes
k engine steps; release frees the session's KV blocks; a failed call forgets only its rows; the
capacity and unknown-id contracts are ``VllmDraftWorker``'s; prefix caching must be off.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import _build_tiny_llama
from specdec.engine.worker_base import DraftCapacityError
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.draft_sessions import VllmSessionDraftWorker, _common_prefix
from specdec.vllm_backend.engine import VllmEngineConfig

SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
VOCAB = 128
MAX_LEN = 256
GREEDY = SamplingParams(temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(dir, HF model) of a tiny draft."""
    hf = _build_tiny_llama(num_layers=2, seed=3, **SHAPE)
    path = str(tmp_path_factory.mktemp("draft"))
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _cfg(path: str, **kwargs) -> VllmEngineConfig:
    return VllmEngineConfig(**{"model": path, "max_num_seqs": 8, "max_model_len": MAX_LEN, "enforce_eager": True,
                               "kv_cache_space_gib": 0.05, "enable_prefix_caching": False, **kwargs})


@pytest.fixture(scope="module")
def worker(model):
    return VllmSessionDraftWorker(_cfg(model[0]), seed=0)


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(ids) - n:]


def _free_blocks(worker) -> int:
    return worker._scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_drafts_are_the_greedy_continuation_of_the_committed_sequence_after_any_outcome(worker, model):
    rng = random.Random(0)
    seqs = {f"g{i}": [rng.randrange(3, VOCAB) for _ in range(20 + 7 * i)] for i in range(4)}
    worker.add_requests([(rid, seq, GREEDY) for rid, seq in seqs.items()])
    drafts = {rid: [] for rid in seqs}
    try:
        for call in range(8):
            committed, ks = [], []
            for i, rid in enumerate(seqs):
                start = len(seqs[rid])
                accepted = rng.randint(0, len(drafts[rid]))   # a prefix of the drafts, then a recovered token
                new = drafts[rid][:accepted] + [rng.randrange(3, VOCAB)] if call % 4 != 3 or i else []
                seqs[rid] += new                                # (call 3, 7: row 0 commits nothing new)
                committed.append((start, new))
                ks.append(0 if (call + i) % 5 == 4 else 1 + (call + i) % 4)   # ragged, some rows undrafted
            rows, probs = worker.draft(list(seqs), committed, ks)
            assert probs is None
            for (rid, seq), row, k_i in zip(seqs.items(), rows, ks):
                assert row == _hf_greedy(model[1], seq, k_i), (call, rid)
                drafts[rid] = row if k_i else drafts[rid][:0]
    finally:
        for rid in seqs:
            worker.release(rid)


def test_a_call_admits_nothing_takes_k_steps_and_release_frees_the_kv(worker, monkeypatch):
    free = _free_blocks(worker)
    prompts = {f"s{i}": list(range(3, 40 + i)) for i in range(3)}
    worker.add_requests([(rid, p, GREEDY) for rid, p in prompts.items()])
    assert _free_blocks(worker) < free
    added, steps, add, step = [], [], worker.engine.add_request, worker.engine.engine_core.get_output
    monkeypatch.setattr(worker.engine, "add_request", lambda *a, **kw: (added.append(1), add(*a, **kw))[1])
    monkeypatch.setattr(worker.engine.engine_core, "get_output", lambda: (steps.append(1), step())[1])   # engine steps
    worker.call_stats.calls.clear()
    for call in range(3):
        steps.clear()
        rows, _ = worker.draft(list(prompts), [(len(p), [5]) for p in prompts.values()], 4)
        for p in prompts.values():
            p.append(5)
        assert [len(r) for r in rows] == [4, 4, 4] and len(steps) == 4 and not added
    # the service's per-call split (specdec.vllm_backend.call_stats): 3 rows, a first step and 3 later ones
    assert [(c.rows, len(c.later_ms)) for c in worker.call_stats.calls] == [(3, 3)] * 3
    assert len(worker.engine.output_processor.request_states) == 3   # one per session, freed by release
    assert all(c.total_ms >= c.admit_ms + c.first_step_ms + sum(c.later_ms) > 0 for c in worker.call_stats.calls)
    for rid in prompts:
        worker.release(rid)
    assert _free_blocks(worker) == free and worker.num_active == 0
    assert not worker._scheduler.requests   # no session left in vLLM's scheduler
    assert not worker.engine.output_processor.request_states
    with pytest.raises(KeyError):
        worker.release("s0")


def test_a_failed_call_forgets_its_rows_only(worker, monkeypatch):
    free = _free_blocks(worker)
    worker.add_requests([("keep", list(range(3, 30)), GREEDY), ("lost", list(range(4, 33)), GREEDY)])
    monkeypatch.setattr(worker.engine.engine_core, "get_output", lambda: (_ for _ in ()).throw(RuntimeError("engine died")))
    with pytest.raises(RuntimeError, match="engine died"):
        worker.draft(["lost"], [(29, [7])], 2)
    monkeypatch.undo()
    with pytest.raises(KeyError):
        worker.draft(["lost"], [(30, [8])], 2)
    assert worker.draft(["keep"], [(27, [9])], 2)[0][0] and worker.num_active == 1
    worker.release("keep")
    assert _free_blocks(worker) == free


def test_capacity_and_unknown_ids_and_prefix_caching(worker, model):
    prompt = [3 + i % 100 for i in range(200)]
    worker.add_requests([("cap", prompt, GREEDY)])
    try:
        fits, _ = worker.draft(["cap"], [(200, [7] * 52)], 4)   # 200 + 52 + 4 = 256: fits
        with pytest.raises(DraftCapacityError):
            worker.draft(["cap"], [(200, [8] * 53)], 4)
        assert worker.draft(["cap"], [(252, [])], 4)[0] == fits   # nothing new: the same drafts
        with pytest.raises(KeyError):
            worker.draft(["cap", "nobody"], [(252, []), (0, [3])], 1)
    finally:
        worker.release("cap")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        VllmSessionDraftWorker(_cfg(model[0], enable_prefix_caching=True), engine=worker.engine)


@pytest.mark.parametrize("a, b, hint, expected", [([1, 2, 3], [1, 2, 4], 2, 2), ([1, 2, 3], [1, 2, 3, 4], 3, 3),
                                                  ([1, 2, 3], [9, 2, 3], 2, 0), ([1, 2], [1, 2], 5, 2), ([], [1], 0, 0)])
def test_common_prefix_whatever_the_hint(a, b, hint, expected):
    assert _common_prefix(a, b, hint) == expected
