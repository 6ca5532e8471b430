"""The distillation data set (``distill.run`` steps 1-3): chat prompts, the target's answers,
the task (``distill.tasks``) and self-prompt (``distill.self_prompts``) stages and the teacher
top-k logits, each cached in the work dir (``distill.data``), so a rerun resumes.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import replace

import torch

from distill import self_prompts, task_prompts
from distill import tasks as distill_tasks
from distill.config import DistillConfig
from distill.data import (EVAL_FILE, _cached, _eos_ids, data_key, encode_prompt_texts, eval_turns,
                          generate_responses, load_prompts, teacher_topk)

logger = logging.getLogger(__name__)


def build_dataset(cfg: DistillConfig, target, tokenizer, device: str, with_teacher: bool = True,
                  t0: float | None = None):
    """(train pairs, train teacher top-k, held-out chat pairs, held-out task pairs, summary),
    cached in the work dir; the self-prompt stage (``distill.self_prompts``) runs when
    ``num_self_prompts``, the task stage (``distill.tasks``) when ``num_task_prompts``.
    ``with_teacher=False`` skips the teacher top-k (returned as None; EAGLE training recomputes it).
    ``t0``: ``time.perf_counter()`` at the start of the run, for ``cfg.data_budget_s`` (None: now)."""
    t0 = time.perf_counter() if t0 is None else t0
    if not os.path.isdir(cfg.data_dir):
        raise FileNotFoundError(f"data_dir: {cfg.data_dir!r} is not a directory")
    if not os.path.exists(os.path.join(cfg.data_dir, EVAL_FILE)):
        logger.warning("data_dir %s has no %s: no evaluation-set exclusion", cfg.data_dir, EVAL_FILE)
    prompts = load_prompts(cfg.data_dir)
    random.Random(cfg.seed).shuffle(prompts)
    texts = encode_prompt_texts(tokenizer, prompts, cfg.max_prompt_tokens)[:cfg.max_prompts + cfg.num_heldout]
    encoded = [ids for _, ids in texts]
    heldout, train = encoded[:cfg.num_heldout], encoded[cfg.num_heldout:]
    eos = _eos_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    work = cfg.work_dir

    def gen(ps, temp):
        return generate_responses(target, ps, cfg, eos, pad, temp)

    greedy = _cached(os.path.join(work, "greedy.pt"), lambda: gen(train, 0.0))
    pairs = greedy
    for s in range(cfg.num_samples):
        torch.manual_seed(cfg.seed + 1 + s)
        pairs = pairs + _cached(os.path.join(work, f"sampled{s}.pt"), lambda: gen(train, cfg.sample_temperature))
    pairs = [p for p in pairs if p[1]]
    task_held, task_summary = [], {}
    turns = eval_turns(cfg.data_dir)
    if cfg.num_task_prompts:
        docs = distill_tasks.documents(tokenizer, [t for t, _ in texts[cfg.num_heldout:]], greedy)
        task_cfg = replace(cfg, max_new_tokens=cfg.task_new_tokens or cfg.max_new_tokens)
        task_pairs, task_held, task_summary = distill_tasks.build_task_stage(
            cfg, tokenizer, docs, turns, lambda ps, temp: generate_responses(target, ps, task_cfg, eos, pad, temp),
            lambda name, make: _cached(os.path.join(work, name), make))
        pairs = pairs + task_pairs
    if cfg.num_self_prompts:
        self_pairs, self_summary = self_prompts.build_self_stage(
            cfg, target, tokenizer, task_prompts.eval_ngrams(turns), lambda ps: gen(ps, 0.0),
            lambda name, make, skip=False: _cached(os.path.join(work, name), make, skip), t0)
        pairs = pairs + self_pairs
        task_summary = {**task_summary, **self_summary}
    teacher = None
    if with_teacher:
        teacher = _cached(os.path.join(work, f"teacher_{data_key(pairs)}.pt"),
                          lambda: teacher_topk(target, pairs, cfg, device))
    held = _cached(os.path.join(work, "heldout.pt"), lambda: gen(heldout, 0.0))
    return pairs, teacher, held, task_held, task_summary
