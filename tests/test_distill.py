"""Draft distillation (issue 4): loss, data selection, a few training steps lower the loss."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distill import run as distill
from specdec.models import draft_format as fmt

NUM_TARGET_LAYERS = 4
EOS = 2


def _cfg(tmp_path, **kw) -> distill.DistillConfig:
    base = dict(target="unused", out_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "work"),
                num_layers=1, batch_size=4, num_epochs=6, lr=3e-3, top_k_logits=16,
                max_new_tokens=12, gen_batch_size=4, checkpoint_every=5, seed=0)
    base.update(kw)
    os.makedirs(base["work_dir"], exist_ok=True)
    return distill.DistillConfig(**base)


def _data(target, cfg):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in (5, 8, 6, 9, 7, 4, 10, 6)]
    pairs = distill.generate_responses(target, prompts, cfg, (EOS,), 0, temperature=0.0)
    pairs = [p for p in pairs if p[1]]
    return pairs, distill.teacher_topk(target, pairs, cfg, "cpu")


@torch.no_grad()
def _mean_loss(draft, pairs, teacher) -> float:
    return float(distill.train_step(draft, pairs, teacher, "cpu")[0])


def test_distill_loss_is_zero_for_a_copy_and_positive_otherwise():
    logits = torch.randn(5, 32)
    vals, idx = logits.topk(32, dim=-1)
    assert distill.distill_loss(logits, vals, idx).abs() < 1e-5
    assert distill.distill_loss(torch.randn(5, 32), vals, idx) > 0.01


def test_pad_batch_marks_positions_predicting_response_tokens():
    ids, mask, is_resp = distill.pad_batch([([1, 2, 3], [4, 5]), ([1], [6])], "cpu")
    assert ids.tolist() == [[1, 2, 3, 4, 5], [1, 6, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert is_resp.tolist() == [[False, False, True, True, False], [True, False, False, False, False]]


def test_a_few_training_steps_lower_the_loss(tmp_path, tiny_llama):
    torch.manual_seed(0)
    target = tiny_llama(num_layers=NUM_TARGET_LAYERS, seed=3)
    cfg = _cfg(tmp_path)
    pairs, teacher = _data(target, cfg)
    draft = fmt.build_draft_from_target(target, [0])
    before = _mean_loss(draft, pairs, teacher)
    embed_before = target.model.embed_tokens.weight.clone()
    summary = distill.train(cfg, draft, pairs, teacher, "cpu", tag="0")
    after = _mean_loss(draft, pairs, teacher)
    assert after < 0.7 * before, (before, after)
    assert summary["num_steps"] == cfg.num_epochs * 2 and summary["num_train_tokens"] > 0
    torch.testing.assert_close(target.model.embed_tokens.weight, embed_before)  # frozen, shared
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert distill.top1_agreement(draft, target, pairs, "cpu", 4) > 0.0


def test_training_resumes_from_checkpoint(tmp_path, tiny_llama):
    target = tiny_llama(num_layers=NUM_TARGET_LAYERS, seed=3)
    cfg = _cfg(tmp_path, num_epochs=2)
    pairs, teacher = _data(target, cfg)
    first = distill.train(cfg, fmt.build_draft_from_target(target, [1]), pairs, teacher, "cpu", tag="1")
    fresh = fmt.build_draft_from_target(target, [1])
    resumed = distill.train(cfg, fresh, pairs, teacher, "cpu", tag="1")
    assert resumed["num_steps"] == first["num_steps"]
    assert resumed["final_kl"] == pytest.approx(first["final_kl"])
    ckpt = torch.load(os.path.join(cfg.work_dir, "ckpt_1.pt"), weights_only=False)
    torch.testing.assert_close(fmt.own_state_dict(fresh), ckpt["draft"])


def test_load_prompts_excludes_the_evaluation_set(tmp_path):
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "arena_hard").mkdir()
    rows = [{"turns": ["shared question", "second"]}, {"turns": ["train only"]}]
    (tmp_path / "mt_bench" / "question.jsonl").write_text("\n".join(map(json.dumps, rows)))
    (tmp_path / "spec_bench" / "question.jsonl").write_text(json.dumps({"turns": ["shared question"]}))
    (tmp_path / "arena_hard" / "arena-hard-v0.1_question.jsonl").write_text(
        json.dumps({"prompt": "arena prompt"}) + "\n" + json.dumps({"prompt": "train only"}))
    assert distill.load_prompts(str(tmp_path)) == ["arena prompt", "train only"]


def test_default_init_layers_span_first_to_last():
    assert distill.default_init_layers(30, 1) == (0,)
    assert distill.default_init_layers(30, 2) == (0, 29)
    assert distill.default_init_layers(30, 3) == (0, 14, 29)


def test_config_validation_and_cli(tmp_path):
    with pytest.raises(ValueError, match="num_layers"):
        distill.DistillConfig(target="t", out_dir="o", num_layers=0)
    with pytest.raises(ValueError, match="init_layers"):
        distill.DistillConfig(target="t", out_dir="o", num_layers=2, init_layers=(0,))
    cfg = distill.parse_args(["--out", "d", "--init-layers", "0,5,9", "--lr", "1e-3", "--seed", "7"])
    assert cfg.init_layers == (0, 5, 9) and cfg.num_layers == 3 and cfg.lr == 1e-3 and cfg.seed == 7


def test_frequent_token_ids_rank_response_tokens_and_keep_eos():
    pairs = [([1, 2], [7, 7, 7, 9, 9, 4]), ([3], [9, 5, 7])]
    assert distill.frequent_token_ids(pairs, 2).tolist() == [7, 9]
    assert distill.frequent_token_ids(pairs, 3, always=(EOS,)).tolist() == [EOS, 7, 9]
    assert distill.frequent_token_ids(pairs, 99).tolist() == [4, 5, 7, 9]


def test_distill_loss_renormalises_over_a_reduced_vocab():
    vals = torch.tensor([[3.0, 1.0, 0.5]])
    draft_logits = torch.tensor([[1.0, 3.0]])  # draft ids: index 0 <- teacher token 2nd, 1 <- 1st
    idx = torch.tensor([[1, 0, -1]])             # the third teacher token is outside the draft vocab
    p = torch.softmax(torch.tensor([3.0, 1.0]), -1)
    q = torch.softmax(torch.tensor([3.0, 1.0]), -1)
    assert distill.distill_loss(draft_logits, vals, idx).abs() < 1e-6
    assert float(distill.distill_loss(torch.tensor([[3.0, 1.0]]), vals, idx)) == pytest.approx(
        float((p * (p.log() - q.flip(0).log())).sum()), rel=1e-5)


def test_training_a_reduced_vocab_draft_lowers_the_loss(tmp_path, tiny_llama):
    torch.manual_seed(0)
    target = tiny_llama(num_layers=NUM_TARGET_LAYERS, seed=3)
    cfg = _cfg(tmp_path)
    pairs, teacher = _data(target, cfg)
    vocab_ids = distill.frequent_token_ids(pairs, 24, always=(EOS,))
    lut = distill.target_to_draft_index(vocab_ids, target.config.vocab_size)
    assert torch.equal(lut[vocab_ids], torch.arange(len(vocab_ids)))
    draft = fmt.build_draft_from_target(target, [0], vocab_ids)
    with torch.no_grad():
        before = float(distill.train_step(draft, pairs, teacher, "cpu", lut)[0])
    distill.train(cfg, draft, pairs, teacher, "cpu", tag="0")
    with torch.no_grad():
        after = float(distill.train_step(draft, pairs, teacher, "cpu", lut)[0])
    assert after < 0.7 * before, (before, after)
    assert distill.top1_agreement(draft, target, pairs, "cpu", 4) > 0.0


def test_cosine_factor_anneals_by_steps_or_by_the_time_budget():
    assert distill.cosine_factor(0, 100, 0.0, None) == 1.0
    assert abs(distill.cosine_factor(50, 100, 999.0, None) - 0.5) < 1e-9  # no budget: steps only
    assert abs(distill.cosine_factor(10, 100, 50.0, 100.0) - 0.5) < 1e-9  # half the time left is gone
    assert distill.cosine_factor(10, 100, 150.0, 100.0) == 0.0  # out of time: fully annealed
    assert abs(distill.cosine_factor(75, 100, 1.0, 100.0) - distill.cosine_factor(75, 100, 0.0, None)) < 1e-9
