"""``minedraft distill``: train a small draft model for a target by knowledge distillation.

Recipe (issue 4; distillation for speculative decoding after DistillSpec, Zhou et al. 2024, Sec. 3):

1. Prompts from arena_hard, mt_bench and fastchat_sample (chat template); prompts that also occur
   in Spec-Bench (the evaluation set) are dropped. A held-out share is kept for evaluation.
   ``--num-task-prompts`` adds synthetic Spec-Bench-like task prompts (``distill.task_prompts``:
   summarization, RAG, translation, math, QA, multi-turn; data code in ``distill.data``).
   ``--num-self-prompts`` adds chat prompts the target writes itself (``distill.self_prompts``,
   Magpie); ``--data-only`` stops after the data stage, ``--data-budget-s`` bounds it.
2. The TARGET generates the responses (one greedy plus ``--num-samples`` sampled per prompt).
3. One target forward per sequence keeps the top-``k`` next-token logits at response positions.
4. The draft (``--init-layers`` copied from the target, or ``--init-draft`` weights; embeddings and LM head shared and frozen)
   minimises ``KL(p_target || q_draft)`` with ``p`` renormalised over the kept top-k tokens:
   ``L = sum_v p(v) (log p(v) - log q(v))`` averaged over response tokens.
5. Summary: final loss, tokens, wall time (s), greedy top-1 agreement with the target on the
   held-out prompts (teacher-forced over target greedy responses).

Resumable: generated data, teacher logits and (step, weights, optimizer) checkpoints live in
``--work-dir``; rerunning the same command continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch

from distill.config import DEFAULT_DATA_DIR, FIELD_HELP, DistillConfig  # noqa: F401  (re-exported: the public distill API)
from distill.data import (  # noqa: F401  (re-exported: the public distill API)
    EVAL_FILE, TRAIN_FILES, _eos_ids, data_key, encode_prompt_texts, encode_prompts, frequent_token_ids,
    generate_responses, load_prompts, load_target, pad_batch, response_coverage, target_to_draft_index, teacher_topk)
from distill.dataset import build_dataset
from distill.train import (  # noqa: F401  (re-exported: the public distill API)
    cosine_factor, distill_loss, top1_agreement, train, train_step)
from specdec.models import draft_format as fmt
from specdec.models.cache import cache_root

def default_init_layers(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """Evenly spaced target layers, always including the first and the last."""
    if num_layers == 1:
        return (0,)
    step = (num_target_layers - 1) / (num_layers - 1)
    return tuple(round(i * step) for i in range(num_layers))


def run(cfg: DistillConfig) -> dict:
    """Full pipeline; writes the draft to ``cfg.out_dir`` and returns the summary dict."""
    t0 = time.perf_counter()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if cfg.work_dir is None:
        # work data stays out of the draft dir
        cfg = replace(cfg, work_dir=os.path.join(cache_root(), "distill", os.path.basename(os.path.abspath(cfg.out_dir))))
    os.makedirs(cfg.work_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_target(cfg, device)
    if cfg.is_data_only:
        pairs, _, held, task_held, summary = build_dataset(cfg, target, tokenizer, device, with_teacher=False, t0=t0)
        return {**summary, "num_train_sequences": len(pairs), "num_train_tokens": sum(len(r) for _, r in pairs),
                "num_heldout_sequences": len(held), "num_task_heldout_sequences": len(task_held),
                "wall_time_s": round(time.perf_counter() - t0, 1), "work_dir": cfg.work_dir}
    pairs, teacher, held, task_held, task_summary = build_dataset(cfg, target, tokenizer, device, t0=t0)
    if not pairs:
        raise ValueError(f"no training sequences: no prompt of data_dir {cfg.data_dir!r} or of the task and "
                         "self-prompt stages was kept")
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # hand generation's cached blocks back (a concurrent run shares the GPU)
    layers = cfg.init_layers or default_init_layers(target.config.num_hidden_layers, cfg.num_layers)
    vocab_ids = None
    if cfg.draft_vocab_size:
        vocab_ids = frequent_token_ids(pairs, cfg.draft_vocab_size, _eos_ids(tokenizer, target)).to(device)
    if cfg.init_draft:
        layers = cfg.init_layers or fmt.read_meta(cfg.init_draft).init_layers
    draft = fmt.build_draft_from_target(target, list(layers), vocab_ids).float()
    if cfg.init_draft:
        from distill.tasks import warm_start
        warm_start(draft, cfg.init_draft, target.model.embed_tokens.weight, tuple(layers))
    agree_before = top1_agreement(draft, target, held, device, cfg.batch_size)
    task_before = top1_agreement(draft, target, task_held, device, cfg.batch_size) if task_held else None
    tag = "-".join(map(str, layers)) + "_" + data_key(pairs)  # a checkpoint belongs to one training set
    summary = train(cfg, draft, pairs, teacher, device, tag=tag, t0=t0)
    summary.update(top1_agreement_heldout=top1_agreement(draft, target, held, device, cfg.batch_size),
                   top1_agreement_heldout_before=agree_before, num_train_sequences=len(pairs),
                   num_heldout_sequences=len(held), wall_time_s=round(time.perf_counter() - t0, 1),
                   seed=cfg.seed, device=device, lr=cfg.lr, num_epochs=cfg.num_epochs,
                   top_k_logits=cfg.top_k_logits, max_new_tokens=cfg.max_new_tokens,
                   response_token_coverage=response_coverage(pairs, vocab_ids), init_draft=cfg.init_draft,
                   top1_agreement_task_heldout_before=task_before, num_task_heldout_sequences=len(task_held),
                   top1_agreement_task_heldout=top1_agreement(draft, target, task_held, device, cfg.batch_size)
                   if task_held else None, **task_summary)
    meta = fmt.DraftMeta(target=cfg.record_target or cfg.target, target_fingerprint=fmt.embedding_fingerprint(
        target.model.embed_tokens.weight), num_layers=len(layers), init_layers=tuple(layers),
        target_gguf_file=None if cfg.record_target else cfg.gguf_file, training=summary,
        draft_vocab_size=None if vocab_ids is None else vocab_ids.numel())
    fmt.save_draft(draft, cfg.out_dir, meta, dtype=getattr(torch, cfg.save_dtype))
    return summary


def parse_args(argv: list[str] | None) -> DistillConfig:
    """Command line -> :class:`DistillConfig`."""
    ap = argparse.ArgumentParser(prog="minedraft distill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="alias or HF/GGUF dir of the target")
    ap.add_argument("--out", required=True, dest="out_dir", help="draft directory to write")
    ap.add_argument("--init-layers", default="", help="comma-separated target layers (default: evenly spaced)")
    for f in DistillConfig.__dataclass_fields__.values():
        if f.name in ("target", "out_dir", "init_layers"):
            continue
        help_text = f"{FIELD_HELP.get(f.name, '')} (default: %(default)s)"
        if isinstance(f.default, bool):
            ap.add_argument("--" + f.name.removeprefix("is_").replace("_", "-"), dest=f.name, action="store_true",
                            help=help_text)
            continue
        kind = type(f.default) if f.default is not None else str
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=help_text)
    ns = vars(ap.parse_args(argv))
    ns["init_layers"] = tuple(int(x) for x in ns["init_layers"].split(",") if x.strip())
    if ns["init_layers"]:
        ns["num_layers"] = len(ns["init_layers"])
    try:
        return DistillConfig(**ns)
    except ValueError as exc:
        ap.error(str(exc))  # exits 2 with the usage line, like argparse's own errors


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``minedraft distill`` / ``python -m distill``); prints the JSON summary."""
    summary = run(parse_args(argv))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
