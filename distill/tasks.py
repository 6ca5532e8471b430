"""Distillation stage 2: task prompts (``distill.task_prompts``) answered by the target, and warm start.

Stage 1 (``distill.run.build_dataset``) has the target answer the chat prompts. Those greedy
answers become the documents of the summarization / RAG / multi-turn prompts; translation, math
and QA prompts come from ``distill.task_corpus`` and templates. The target then answers every task
prompt (greedy, plus ``num_task_samples`` sampled at ``sample_temperature``), and the draft is
trained on chat + task sequences alike. Prompts overlapping Spec-Bench (word n-grams) are dropped.
"""

from __future__ import annotations

import gzip
import json

import torch

from specdec.models import draft_format as fmt
from distill import task_corpus
from distill import task_prompts


def load_corpus(path: str | None) -> dict:
    """Corpus JSON (``.json`` or ``.json.gz``) written by ``python -m distill.task_corpus`` (None:
    collect from this system)."""
    if not path:
        return task_corpus.collect()
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def encode_messages(tokenizer, prompts: list[task_prompts.TaskPrompt], max_tokens: int) -> list[tuple[str, list[int]]]:
    """``(task, chat-template ids)`` of each prompt; prompts over ``max_tokens`` tokens are dropped."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if len(ids) <= max_tokens:
            out.append((p.task, list(ids)))
    return out


def documents(tokenizer, prompt_texts: list[str], greedy_pairs) -> list[tuple[str, str]]:
    """``(chat prompt, decoded target response)`` for aligned prompts and greedy ``(ids, response)``."""
    return [(q, tokenizer.decode(r, skip_special_tokens=True).strip()) for q, (_, r) in zip(prompt_texts, greedy_pairs)]


def build_task_stage(cfg, tokenizer, docs, eval_turns: list[str], generate, cached) -> tuple[list, list, dict]:
    """Task training pairs, held-out task pairs and the mix summary.

    Args:
        cfg: ``DistillConfig`` (num_task_prompts, num_task_heldout, num_task_samples, task_corpus,
            max_task_prompt_tokens, seed).
        docs: :func:`documents` of stage 1.
        eval_turns: the evaluation set's texts (Spec-Bench); overlapping prompts are dropped.
        generate: ``(prompt ids list, temperature) -> [(prompt ids, response ids)]`` by the target.
        cached: ``(file name, make) -> value`` (the work-dir cache of ``distill.run``).
    Returns: (train pairs, held-out pairs, summary dict with the prompt mix and sources).
    """
    corpus = load_corpus(cfg.task_corpus)
    mix = task_prompts.TaskMix.from_total(cfg.num_task_prompts + cfg.num_task_heldout, seed=cfg.seed)
    prompts = task_prompts.build_task_prompts(docs, corpus, mix, task_prompts.eval_ngrams(eval_turns))
    encoded = encode_messages(tokenizer, prompts, cfg.max_task_prompt_tokens)
    held_ids = [ids for _, ids in encoded[:cfg.num_task_heldout]]
    train_ids = [ids for _, ids in encoded[cfg.num_task_heldout:]]
    pairs = cached("tasks_greedy.pt", lambda: generate(train_ids, 0.0))
    for s in range(cfg.num_task_samples):
        torch.manual_seed(cfg.seed + 101 + s)
        pairs = pairs + cached(f"tasks_sampled{s}.pt", lambda: generate(train_ids, cfg.sample_temperature))
    held = cached("tasks_heldout.pt", lambda: generate(held_ids, 0.0))
    summary = {"task_mix_built": task_prompts.mix_summary(prompts),
               "task_mix_encoded": {t: sum(task == t for task, _ in encoded) for t in task_prompts.TASKS},
               "task_sources": {**corpus.get("sources", {}), "documents": "prose documents (see prose_sources) and "
                                "target greedy responses to the chat prompts"},
               "prose_sources": corpus.get("prose_sources", {}),
               "num_task_train_prompts": len(train_ids), "num_task_heldout_prompts": len(held_ids)}
    return [p for p in pairs if p[1]], [p for p in held if p[1]], summary


def warm_start(draft, init_dir: str, target_embed: torch.Tensor, layers: tuple[int, ...] | None = None) -> None:
    """Load the own weights (layers + norm) of the draft directory ``init_dir`` into ``draft``.

    Same layer count: layer i -> layer i. Growth (``draft`` has more layers; ``layers`` = the
    draft's target-layer ids, containing all of ``init_dir``'s ``init_layers`` in order): each
    loaded layer goes to the slot of its target layer; the other slots keep their target-layer
    copy with ``o_proj`` and ``down_proj`` zeroed, so they start as identity blocks and the grown
    draft computes exactly the ``init_dir`` function (function-preserving growth, Net2Net, Chen et
    al. 2016, Sec. 2.2). The draft head is not loaded (it is gathered from the target).
    Raises IncompatibleDraftError when ``init_dir`` was trained for another target, ValueError
    when the layers do not fit.
    """
    meta = fmt.read_meta(init_dir)
    fmt.check_fingerprint(meta.target_fingerprint, target_embed)
    slots = growth_slots(meta.init_layers, layers, len(draft.model.layers))
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for key, tensor in fmt.read_draft_weights(init_dir).items():
            if key.startswith(fmt.OWN_WEIGHT_PREFIXES):
                param = params[_slot_key(key, slots)]
                param.copy_(tensor.to(param.dtype))
        for i, layer in enumerate(draft.model.layers):
            if i not in slots:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()


def growth_slots(init_layers: tuple[int, ...], layers: tuple[int, ...] | None, num_layers: int) -> list[int]:
    """Draft slot of each ``init_layers`` entry (identity for an equal count). Raises ValueError."""
    if num_layers == len(init_layers):
        return list(range(num_layers))
    if num_layers < len(init_layers) or layers is None or len(layers) != num_layers:
        raise ValueError(f"init_draft has {len(init_layers)} layers, the draft {num_layers} (growth needs the draft's layers)")
    slots, pos = [], 0
    for src in init_layers:
        if src not in layers[pos:]:
            raise ValueError(f"init_draft layers {init_layers} are not an ordered subset of {layers}")
        pos = layers.index(src, pos) + 1
        slots.append(pos - 1)
    return slots


def _slot_key(key: str, slots: list[int]) -> str:
    """``model.layers.<i>.rest`` -> ``model.layers.<slots[i]>.rest`` (other keys unchanged)."""
    if not key.startswith("model.layers."):
        return key
    index, rest = key[len("model.layers."):].split(".", 1)
    return f"model.layers.{slots[int(index)]}.{rest}"
