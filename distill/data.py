"""Distillation data pieces (``distill.dataset`` puts them together): prompts, target responses,
teacher top-k logits.

- Chat prompts of arena_hard, mt_bench and fastchat_sample (first user turn, chat template);
  any prompt that is also a Spec-Bench turn (the evaluation set) is dropped.
- The TARGET answers them (greedy + sampled, batched by prompt length); with ``num_task_prompts``
  the task stage (``distill.tasks``) adds synthetic Spec-Bench-like task prompts.
- One target forward per sequence keeps the top-k logits at response positions.
- FR-Spec draft vocabulary (Zhao et al. 2025, arXiv 2502.14856): most frequent response ids.

Everything is cached in the work dir (``torch.save``), so a rerun resumes.
"""

from __future__ import annotations

import json
import os

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.config import DistillConfig
from specdec.config import ModelConfig
from specdec.models.resolve import resolve_model_dir


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
    """Target model (eval, frozen) and tokenizer; aliases resolved by ``specdec.models.resolve``."""
    path, gguf = cfg.target, cfg.gguf_file
    if not os.path.isdir(path):
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
