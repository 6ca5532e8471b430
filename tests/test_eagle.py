"""EAGLE-style draft head (issue 4 experiment): the unrolled training/evaluation chain equals
sequential drafting, the add-fusion warm start is the token-level draft, training lowers the
loss, the saved head refuses another target, and the acceptance walk counts steps right."""

from __future__ import annotations

import time

import pytest
import torch
from transformers.cache_utils import DynamicCache

from bench.draft.eagle_acceptance import walk
from distill import run as distill
from specdec.models import draft_format as fmt
from distill.eagle import EagleHead, target_features, unrolled_logits
from distill.eagle_train import (EagleTrainConfig, build_head, chain_loss, load_head, load_pairs, save_head,
                                 save_pairs, train)
from specdec.errors import IncompatibleDraftError

VOCAB_IDS = torch.arange(0, 128, 2)  # a reduced draft vocabulary of the tiny models' 128 ids


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fusion,num_feature_layers", [("concat", 1), ("concat", 2), ("add", 2)])
def test_unrolled_chains_equal_sequential_drafting(tiny_llama, fusion, num_feature_layers):
    torch.manual_seed(0)
    target = tiny_llama(num_layers=3, seed=1)
    layers = (-1,) if num_feature_layers == 1 else (1, 3)
    head = EagleHead(target.config, 2, target.model.embed_tokens.weight, VOCAB_IDS,
                     num_feature_layers=num_feature_layers, fusion=fusion).eval()
    for p in head.parameters():                          # zero-initialised projections too
        torch.nn.init.normal_(p, std=0.2)
    ids = _ids(2, 12)
    with torch.no_grad():
        feats, _ = target_features(target, ids, torch.ones_like(ids), layers)
        steps = unrolled_logits(head, feats, ids, torch.ones(2, 11, dtype=torch.bool), 3)
        p = 5                                            # committed t_0..t_{p+1}; draft t_{p+2..p+4}
        cache = DynamicCache()
        sink = torch.cat([feats.new_zeros(2, 1, feats.shape[-1]), feats[:, :p + 1]], dim=1)
        g = head(sink, ids[:, :p + 2], torch.arange(p + 2).expand(2, -1), None, cache)[:, -1:]
        expected = [head.logits(g[:, 0])]
        for u in (2, 3):                                 # fed the true next token (accepted drafts)
            g = head(g, ids[:, p + u:p + u + 1], torch.full((2, 1), p + u), None, cache, is_target_feature=False)
            expected.append(head.logits(g[:, 0]))
    for u in range(3):
        torch.testing.assert_close(steps[u][:, p], expected[u], rtol=1e-4, atol=1e-5)


def test_add_fusion_warm_start_is_the_token_level_draft(tmp_path, tiny_llama):
    target = tiny_llama(num_layers=3, seed=1)
    draft = fmt.build_draft_from_target(target, [0, 2], VOCAB_IDS)
    meta = fmt.DraftMeta(target="tiny", target_fingerprint=fmt.embedding_fingerprint(target.model.embed_tokens.weight),
                         num_layers=2, init_layers=(0, 2), draft_vocab_size=VOCAB_IDS.numel())
    fmt.save_draft(draft, str(tmp_path / "draft"), meta, dtype=torch.float32)
    cfg = EagleTrainConfig(out_dir=str(tmp_path / "head"), vocab_from=str(tmp_path / "draft"), fusion="add",
                           feature_layers="1,3", init_draft=str(tmp_path / "draft"))
    head = build_head(target, VOCAB_IDS, cfg).eval()
    ids = _ids(1, 10)
    with torch.no_grad():
        feats, _ = target_features(target, ids, torch.ones_like(ids), cfg.layers)
        step1 = unrolled_logits(head, feats, ids, torch.ones(1, 9, dtype=torch.bool), 1)[0]
        token_draft = draft(input_ids=ids).logits
    assert len(head.layers) == 2
    torch.testing.assert_close(step1[0, :8], token_draft[0, 1:9], rtol=1e-4, atol=1e-5)


def _pairs(target):
    cfg = distill.DistillConfig(target="unused", out_dir="unused", max_new_tokens=10, gen_batch_size=4)
    prompts = _ids(6, 6, seed=3).tolist()
    return [p for p in distill.generate_responses(target, prompts, cfg, (2,), 0, temperature=0.0) if p[1]]


def test_a_few_training_steps_lower_the_chain_loss(tmp_path, tiny_llama):
    torch.manual_seed(0)
    target = tiny_llama(num_layers=3, seed=4)
    target.requires_grad_(False)
    pairs = _pairs(target)
    cfg = EagleTrainConfig(out_dir=str(tmp_path / "head"), vocab_from="unused", num_unroll=2, lr=3e-3,
                           warmup_steps=1, num_epochs=15, max_batch_tokens=64, time_budget_s=0.0, prompt_weight=0.0)
    head = build_head(target, VOCAB_IDS, cfg)
    with torch.no_grad():
        before = float(chain_loss(head, target, pairs, cfg, "cpu"))
    summary = train(head, target, pairs, cfg, "cpu", time.perf_counter())
    with torch.no_grad():
        after = float(chain_loss(head, target, pairs, cfg, "cpu"))
    assert summary["num_steps"] == summary["num_planned_steps"] > 0
    assert after < 0.7 * before, (before, after)


def test_saved_head_round_trips_and_refuses_another_target(tmp_path, tiny_llama):
    target = tiny_llama(num_layers=3, seed=1)
    head = EagleHead(target.config, 1, target.model.embed_tokens.weight, VOCAB_IDS,
                     num_feature_layers=2, fusion="add")
    torch.nn.init.normal_(head.feature_proj.weight)
    fp = fmt.embedding_fingerprint(target.model.embed_tokens.weight)
    save_head(head, str(tmp_path), {"target": "tiny", "target_fingerprint": fp, "num_layers": 1,
                                    "feature_layers": [1, 3], "fusion": "add"})
    loaded = load_head(str(tmp_path), target)
    torch.testing.assert_close(loaded.feature_proj.weight, head.feature_proj.weight.to(torch.bfloat16).float())
    assert torch.equal(loaded.vocab_ids, VOCAB_IDS)
    with pytest.raises(IncompatibleDraftError):
        load_head(str(tmp_path), tiny_llama(num_layers=3, seed=9))


def test_pairs_file_round_trip(tmp_path):
    pairs = [([1, 5, 7], [9, 2]), ([4], [3, 3, 2]), ([6, 6], [])]
    save_pairs(pairs, str(tmp_path / "p.npz"))
    assert load_pairs(str(tmp_path / "p.npz")) == pairs


def test_walk_counts_committed_tokens_per_step():
    gen = torch.Generator().manual_seed(0)
    n, prompt_len = 9, 2                                 # 9 tokens: 2 prompt, 1 from prefill, 6 drafted
    steps, per_pos = walk(torch.ones(6, n - 1), prompt_len, 2, gen, 1)
    assert steps == [2, 2] and per_pos == [2, 2]         # m = 3 -> 6 -> 9: 3 tokens per step
    steps, per_pos = walk(torch.zeros(6, n - 1), prompt_len, 4, gen, 1)
    assert steps == [0] * 6 and per_pos == [0] * 4
    acc = torch.ones(6, n - 1)
    acc[1, 1] = 0                                        # chain at m = 3 (p = 1) rejects its 2nd draft
    steps, _ = walk(acc, prompt_len, 3, gen, 1)
    assert steps[0] == 1
