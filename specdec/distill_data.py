"""Distillation data (``specdec.distill`` step 1-3): prompts, target responses, teacher top-k logits.

- Chat prompts of arena_hard, mt_bench and fastchat_sample (first user turn, chat template);
  any prompt that is also a Spec-Bench turn (the evaluation set) is dropped.
- The TARGET answers them (greedy + sampled, batched by prompt length); with ``num_task_prompts``
  the task stage (``specdec.distill_tasks``) adds synthetic Spec-Bench-like task prompts.
- One target forward per sequence keeps the top-k logits at response positions.
- FR-Spec draft vocabulary (Zhao et al. 2025, arXiv 2502.14856): most frequent response ids.

Everything is cached in the work dir (``torch.save``), so a rerun resumes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

if TYPE_CHECKING:
    from specdec.distill import DistillConfig

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = "/work/shared/data"
TRAIN_FILES = ("arena_hard/arena-hard-v0.1_question.jsonl", "arena_hard/arena-hard-v2.0_question.jsonl",
               "mt_bench/question.jsonl", "fastchat_sample/vicuna_bench_question.jsonl",
               "fastchat_sample/dummy_conversation_sharegpt_format.json")
EVAL_FILE = "spec_bench/question.jsonl"


def load_prompts(data_dir: str, files=TRAIN_FILES, exclude_file: str | None = EVAL_FILE) -> list[str]:
    """User prompts (first turn) of ``files``, minus any that occur in ``exclude_file``."""
    excluded = set()
    if exclude_file and os.path.exists(os.path.join(data_dir, exclude_file)):
        excluded = {t for row in _read_rows(os.path.join(data_dir, exclude_file)) for t in row.get("turns", [])}
    prompts = []
    for name in files:
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            prompts += [p for p in map(_first_turn, _read_rows(path)) if p and p not in excluded]
    return list(dict.fromkeys(prompts))


def _read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f) if path.endswith(".json") else [json.loads(line) for line in f if line.strip()]


def _first_turn(row: dict) -> str | None:
    if "prompt" in row:
        return row["prompt"]
    if "turns" in row:
        return row["turns"][0]
    human = [c["value"] for c in row.get("conversations", []) if c.get("from") == "human"]
    return human[0] if human else None


def encode_prompts(tokenizer, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Chat-template token ids of each prompt; prompts over ``max_tokens`` are dropped."""
    return [ids for _, ids in encode_prompt_texts(tokenizer, prompts, max_tokens)]


def encode_prompt_texts(tokenizer, prompts: list[str], max_tokens: int) -> list[tuple[str, list[int]]]:
    """``(prompt, chat-template token ids)``; prompts over ``max_tokens`` tokens are dropped."""
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for p in prompts]
    return [(p, list(x)) for p, x in zip(prompts, ids) if len(x) <= max_tokens]


@torch.no_grad()
def generate_responses(model, prompts: list[list[int]], cfg: DistillConfig, eos_ids, pad_id: int,
                       temperature: float) -> list[tuple[list[int], list[int]]]:
    """Target responses ``(prompt_ids, response_ids)`` in prompt order; greedy when ``temperature == 0``.

    Batches hold prompts of similar length (sorted) to limit padding.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = []
    for start in tqdm(range(0, len(prompts), cfg.gen_batch_size), desc=f"generate T={temperature}"):
        batch = [prompts[i] for i in order[start:start + cfg.gen_batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                             do_sample=temperature > 0, temperature=temperature or None, top_p=None,
                             top_k=None, eos_token_id=list(eos_ids), pad_token_id=pad_id)
        for p, row in zip(batch, gen[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            out.append((p, row[:cut]))
    by_prompt = [None] * len(prompts)
    for i, pair in zip(order, out):
        by_prompt[i] = pair
    return by_prompt


def pad_batch(pairs, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids [b, T]``, ``attention_mask [b, T]``, ``is_response [b, T]``.

    ``is_response[i, t]`` marks positions whose next token is a response token (the trained ones).
    """
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    is_resp = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(pairs):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        mask[i, :n] = 1
        is_resp[i, len(p) - 1:n - 1] = True
    return ids.to(device), mask.to(device), is_resp.to(device)


@torch.no_grad()
def teacher_topk(target, pairs, cfg: DistillConfig, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: target top-k logits ``[n_resp, k]`` (fp16) and token ids ``[n_resp, k]`` (int32)."""
    out = []
    for start in tqdm(range(0, len(pairs), cfg.batch_size), desc="teacher logits"):
        batch = pairs[start:start + cfg.batch_size]
        ids, mask, is_resp = pad_batch(batch, device)
        logits = target(input_ids=ids, attention_mask=mask).logits.float()
        vals, idx = logits.topk(cfg.top_k_logits, dim=-1)
        for i in range(len(batch)):
            out.append((vals[i][is_resp[i]].half().cpu(), idx[i][is_resp[i]].int().cpu()))
    return out


def frequent_token_ids(pairs, num_ids: int, always=()) -> torch.Tensor:
    """FR-Spec draft vocabulary: the ``num_ids`` most frequent response token ids, ascending.

    Ids in ``always`` (e.g. EOS) are included first. Returns int64 ``[min(num_ids, #distinct)]``.
    """
    counts: dict[int, int] = {}
    for _, resp in pairs:
        for t in resp:
            counts[t] = counts.get(t, 0) + 1
    ranked = list(dict.fromkeys([*always, *sorted(counts, key=lambda t: (-counts[t], t))]))
    return torch.tensor(sorted(ranked[:num_ids]), dtype=torch.int64)


def response_coverage(pairs, vocab_ids: torch.Tensor | None) -> float:
    """Share of training response tokens inside the draft vocabulary (1.0 for a full vocab)."""
    if vocab_ids is None:
        return 1.0
    kept = set(vocab_ids.tolist())
    total = sum(len(r) for _, r in pairs)
    return sum(t in kept for _, r in pairs for t in r) / max(total, 1)


def target_to_draft_index(vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """Lookup ``[vocab_size]``: target id -> index in the draft head, -1 outside; None: identity."""
    if vocab_ids is None:
        return None
    lut = torch.full((vocab_size,), -1, dtype=torch.int64, device=vocab_ids.device)
    lut[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
    return lut


def _cached(path: str, make, skip: bool = False):
    """``torch.load(path)`` if it exists, else ``make()`` saved there; ``skip``: None instead of making.

    Raises RuntimeError naming ``path`` when the file exists but cannot be read.
    """
    if os.path.exists(path):
        try:
            return torch.load(path, weights_only=False)
        except Exception as exc:  # torch raises RuntimeError / EOFError / ValueError / pickle errors
            raise RuntimeError(f"cache file {path} is unreadable ({type(exc).__name__}: {exc}); "
                               "delete it to rebuild it") from exc
    if skip:
        return None
    value = make()
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)
    return value


def load_target(cfg: DistillConfig, device: str):
    """Target model (eval, frozen) and tokenizer; aliases resolved by ``specdec.loader``."""
    path, gguf = cfg.target, cfg.gguf_file
    if not os.path.isdir(path):
        from specdec.config import ModelConfig
        from specdec.loader import resolve_model_dir
        path, gguf = resolve_model_dir(ModelConfig(model=cfg.target, gguf_file=cfg.gguf_file)), None
    kwargs = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 target; TF32 matmuls on GPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


def _eos_ids(tokenizer, target) -> tuple[int, ...]:
    gen_eos = target.generation_config.eos_token_id
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    return tuple(dict.fromkeys(t for t in [tokenizer.eos_token_id, *gen_eos] if t is not None))


def data_key(pairs) -> str:
    """``<sequences>x<tokens>`` of ``pairs``: names the caches that belong to one training set
    (teacher logits, checkpoints), so a run whose data grew does not reuse stale ones."""
    return f"{len(pairs)}x{sum(len(p) + len(r) for p, r in pairs)}"


def eval_turns(data_dir: str) -> list[str]:
    """Every turn of the evaluation set (Spec-Bench) under ``data_dir`` ([] when absent)."""
    path = os.path.join(data_dir, EVAL_FILE)
    return [t for row in _read_rows(path) for t in row.get("turns", [])] if os.path.exists(path) else []


def build_dataset(cfg: DistillConfig, target, tokenizer, device: str, with_teacher: bool = True,
                  t0: float | None = None):
    """(train pairs, train teacher top-k, held-out chat pairs, held-out task pairs, summary),
    cached in the work dir; the self-prompt stage (``specdec.self_prompts``) runs when
    ``num_self_prompts``, the task stage (``specdec.distill_tasks``) when ``num_task_prompts``.
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
        from specdec import distill_tasks
        docs = distill_tasks.documents(tokenizer, [t for t, _ in texts[cfg.num_heldout:]], greedy)
        task_cfg = replace(cfg, max_new_tokens=cfg.task_new_tokens or cfg.max_new_tokens)
        task_pairs, task_held, task_summary = distill_tasks.build_task_stage(
            cfg, tokenizer, docs, turns, lambda ps, temp: generate_responses(target, ps, task_cfg, eos, pad, temp),
            lambda name, make: _cached(os.path.join(work, name), make))
        pairs = pairs + task_pairs
    if cfg.num_self_prompts:
        from specdec import self_prompts, task_prompts
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
