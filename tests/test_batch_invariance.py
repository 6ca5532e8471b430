"""Issue 25.1: a row's sampling distribution depends only on its own parameters, bit for bit.

A seeded request must give the same text alone and among batch-mates that use top-k, top-p,
min-p or penalties: ``specdec.sample.sampling.logits_to_probs`` must leave the rows that do not ask for
a processor untouched (float32 cumulative sums reach 1.0 before the tail of the vocabulary, so a
top-p test run on a ``top_p = 1.0`` row masks real tokens; a min-p renormalisation rescales it).
"""

from __future__ import annotations

import pytest
import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.models.draft_format import build_draft_from_target
from reference.loop import LoopConfig, ReferenceLoop, Request
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams, logits_to_probs
from specdec.engine.worker import DraftWorker, TargetWorker

torch.set_num_threads(1)

PLAIN = SamplingParams(temperature=1.0)
MATES = [SamplingParams(top_k=20), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1),
         SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.5, min_p=0.05)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("vocab_size", [128, 49152])
def test_each_row_is_bit_identical_alone_and_in_any_batch(dtype, vocab_size):
    logits = torch.randn(len(MATES) + 1, 3, vocab_size, generator=torch.Generator().manual_seed(0),
                         dtype=dtype) * 3
    params = [PLAIN, *MATES]
    batched = logits_to_probs(logits, params)
    for row, p in enumerate(params):
        alone = logits_to_probs(logits[row:row + 1], [p])[0]
        assert torch.equal(batched[row], alone), (row, p)
    # a plain row keeps every token: nothing of its tail is masked by a batch-mate's top-p
    assert bool((batched[0] > 0).all()) == bool((logits[0].softmax(-1) > 0).all())


def _workers(tiny_llama, vocab_size):
    target_model = tiny_llama(vocab_size=vocab_size)
    cache = CacheConfig(max_num_seqs=8, max_model_len=96)
    target = TargetWorker(ModelRunner(ModelConfig(), cache, model=target_model), seed=0)
    draft_model = build_draft_from_target(target.runner.model, [0])
    return target, DraftWorker(ModelRunner(ModelConfig(), cache, model=draft_model), seed=1)


def _spy_target_probs(monkeypatch) -> list[torch.Tensor]:
    """Record the target probs [b, k + 1, V] that TargetWorker.verify gives the rejection sampler."""
    import specdec.engine.worker as worker_module

    seen, original = [], worker_module.rejection_sample
    monkeypatch.setattr(worker_module, "rejection_sample",
                        lambda ids, q, p, *args: seen.append(p.clone()) or original(ids, q, p, *args))
    return seen


def _verify_then_draft(tiny_llama, params: list[SamplingParams], monkeypatch):
    """Row 0's target probs of one verify step and its draft probs of one draft call."""
    target, drafter = _workers(tiny_llama, 8192)
    seen = _spy_target_probs(monkeypatch)
    prompts = [[1, 17, 300, 4000, 12, 9], [1, 5, 6], [1, 900, 901, 902], [1, 2]][: len(params)]
    ids = [f"r{i}" for i in range(len(params))]
    firsts = target.add_requests(list(zip(ids, prompts, params)))
    drafter.add_requests(list(zip(ids, prompts, params)))
    drafts, q = drafter.draft(ids, [(len(p), out.token_ids) for p, out in zip(prompts, firsts)], 4)
    target.verify(ids, drafts, q)
    return seen[-1][0], q[0]


@pytest.mark.parametrize("mate", [SamplingParams(top_k=20, seed=3), SamplingParams(top_p=0.9, seed=3),
                                  SamplingParams(min_p=0.1, seed=3)])
def test_target_and_draft_probs_of_a_row_do_not_depend_on_batch_mates(tiny_llama, mate, monkeypatch):
    """Against a batch of the same shape whose mates use no processor (a float32 forward of
    another batch size may differ in the last bits, which no sampler can undo)."""
    seeded, plain = SamplingParams(temperature=1.0, seed=7, max_tokens=40), SamplingParams(seed=3)
    p_plain, q_plain = _verify_then_draft(tiny_llama, [seeded, plain, plain, plain], monkeypatch)
    p_crowd, q_crowd = _verify_then_draft(tiny_llama, [seeded, mate, mate, mate], monkeypatch)
    assert torch.equal(q_crowd, q_plain)
    assert torch.equal(p_crowd, p_plain)


def _psd(tiny_llama, prompts, params, vocab_size):
    target, drafter = _workers(tiny_llama, vocab_size)
    requests = [Request(f"r{i}", list(p), ps) for i, (p, ps) in enumerate(zip(prompts, params))]
    ReferenceLoop(LoopConfig("psd", 4, 4), target, drafter).run(requests)
    return requests


@pytest.mark.parametrize("mate", [SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=40),
                                  SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=40)])
def test_seeded_psd_request_text_does_not_depend_on_top_k_top_p_batch_mates(tiny_llama, mate):
    """The issue's case on a tiny float32 model: seed 7, T = 1.0, 40 tokens, psd k = 4 m = 4."""
    vocab_size, prompt = 8192, [1, 17, 300, 4000, 12, 9]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    alone = _psd(tiny_llama, [prompt], [seeded], vocab_size)[0].output_token_ids
    mates = [mate, SamplingParams(**{**mate.__dict__, "seed": 12}), SamplingParams(**{**mate.__dict__, "seed": 13})]
    crowd = _psd(tiny_llama, [prompt, [1, 5, 6], [1, 900, 901, 902], [1, 2]], [seeded, *mates], vocab_size)
    assert len(alone) == 40
    assert crowd[0].output_token_ids == alone
