"""``minedraft distill``: train a small draft model for a target by knowledge distillation.

Recipe (issue 4; distillation for speculative decoding after DistillSpec, Zhou et al. 2024, Sec. 3):

1. Prompts from arena_hard, mt_bench and fastchat_sample (chat template); prompts that also occur
   in Spec-Bench (the evaluation set) are dropped. A held-out share is kept for evaluation.
   ``--num-task-prompts`` adds synthetic Spec-Bench-like task prompts (``specdec.task_prompts``:
   summarization, RAG, translation, math, QA, multi-turn; data code in ``specdec.distill_data``).
   ``--num-self-prompts`` adds chat prompts the target writes itself (``specdec.self_prompts``,
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
from dataclasses import dataclass, replace

import torch

from specdec import draft_format as fmt
from specdec.distill_data import (  # noqa: F401  (re-exported: the public distill API)
    DEFAULT_DATA_DIR, EVAL_FILE, TRAIN_FILES, _eos_ids, build_dataset, data_key, encode_prompt_texts, encode_prompts,
    frequent_token_ids, generate_responses, load_prompts, load_target, pad_batch, response_coverage,
    target_to_draft_index, teacher_topk)
from specdec.distill_train import (  # noqa: F401  (re-exported: the public distill API)
    cosine_factor, distill_loss, top1_agreement, train, train_step)

FIELD_HELP = {
    "gguf_file": "GGUF file name inside --target (a dir)", "work_dir": "data cache + checkpoints (default $MINEDRAFT_CACHE/distill/<out name>)",
    "data_dir": "dir with arena_hard/, mt_bench/, fastchat_sample/, spec_bench/ (excluded)",
    "num_layers": "draft decoder layers", "max_prompts": "training prompts", "num_heldout": "held-out prompts",
    "max_prompt_tokens": "drop longer prompts (tokens)", "max_new_tokens": "target response length (tokens)",
    "num_samples": "sampled responses per prompt besides the greedy one", "sample_temperature": "their temperature",
    "top_k_logits": "teacher logits kept per position", "gen_batch_size": "generation batch (sequences)",
    "batch_size": "training batch (sequences)", "num_epochs": "epochs", "lr": "AdamW peak learning rate (cosine)",
    "seed": "seed of shuffling, sampling and batching", "device": "auto | cpu | cuda[:i]",
    "save_dtype": "dtype of the saved draft weights", "checkpoint_every": "steps between checkpoints",
    "record_target": "target alias written to the draft metadata (default --target)",
    "draft_vocab_size": "reduced draft head: the N most frequent target ids of the responses (0: full vocab)",
    "time_budget_s": "stop training once the whole run took this many seconds, then evaluate + save (0: none)",
    "num_task_prompts": "synthetic task prompts (specdec.task_prompts: summarization, RAG, translation, math, QA, multi-turn)",
    "num_task_heldout": "held-out task prompts", "num_task_samples": "sampled responses per task prompt besides the greedy one",
    "task_corpus": "corpus JSON (.json/.json.gz) of python -m specdec.task_corpus (default: collect from this system)",
    "max_task_prompt_tokens": "drop longer task prompts (tokens)", "task_new_tokens": "task response length (0: max_new_tokens)",
    "num_self_prompts": "chat prompts sampled from the target itself (specdec.self_prompts, Magpie) and answered greedily",
    "max_self_prompt_tokens": "longest self-sampled query (tokens; longer ones are dropped)",
    "self_prompt_temperature": "temperature of the self-sampled queries",
    "data_budget_s": "stop sampling new self-prompt chunks once the run took this many seconds (0: none)",
    "is_data_only": "build and cache the generated data (no teacher logits, no training), then exit",
    "init_draft": "draft dir to warm-start the layers from (fewer layers: grown, see distill_tasks.warm_start)",
}


@dataclass(frozen=True)
class DistillConfig:
    """Training settings (see ``--help``). Raises ValueError naming a bad field."""

    target: str
    out_dir: str
    gguf_file: str | None = None
    work_dir: str | None = None
    data_dir: str = DEFAULT_DATA_DIR
    init_layers: tuple[int, ...] = ()
    num_layers: int = 2
    max_prompts: int = 600
    num_heldout: int = 24
    max_prompt_tokens: int = 384
    max_new_tokens: int = 128
    num_samples: int = 0
    sample_temperature: float = 0.8
    top_k_logits: int = 64
    gen_batch_size: int = 16
    batch_size: int = 8
    num_epochs: int = 3
    lr: float = 5e-4
    seed: int = 0
    device: str = "auto"
    save_dtype: str = "bfloat16"
    record_target: str | None = None
    checkpoint_every: int = 200
    draft_vocab_size: int = 0
    time_budget_s: float = 0.0
    num_task_prompts: int = 0
    num_task_heldout: int = 0
    num_task_samples: int = 0
    task_corpus: str | None = None
    max_task_prompt_tokens: int = 1024
    task_new_tokens: int = 0
    init_draft: str | None = None
    num_self_prompts: int = 0
    max_self_prompt_tokens: int = 128
    self_prompt_temperature: float = 1.0
    data_budget_s: float = 0.0
    is_data_only: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "max_prompts", "max_prompt_tokens", "max_new_tokens", "top_k_logits",
                     "gen_batch_size", "batch_size", "num_epochs", "checkpoint_every", "max_self_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_samples", "num_heldout", "draft_vocab_size", "time_budget_s", "num_task_prompts",
                     "num_task_heldout", "num_task_samples", "max_task_prompt_tokens", "task_new_tokens",
                     "num_self_prompts", "data_budget_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "sample_temperature", "self_prompt_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.init_layers and len(self.init_layers) != self.num_layers:
            raise ValueError(f"init_layers must have num_layers={self.num_layers} entries")
        if self.save_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"save_dtype must be bfloat16 or float32, got {self.save_dtype!r}")


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
        from specdec.loader import cache_root  # work data stays out of the draft dir
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
        from specdec.distill_tasks import warm_start
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
    """CLI entry (``minedraft distill`` / ``python -m specdec.distill``); prints the JSON summary."""
    summary = run(parse_args(argv))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
