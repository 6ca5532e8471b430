"""Distillation stage 1b: chat prompts written by the target itself (Magpie).

Magpie (Xu et al. 2024, arXiv 2406.08464, Sec. 2.1): an instruction-tuned model given only its
chat template up to the start of a user turn (the *pre-query template*) samples a user query
from the distribution it was tuned on. The target then answers each query (greedy), and the
draft is distilled on those answers like on the offline chat prompts.

Why: the offline prompt files hold ~1,400 chat prompts, mostly Arena-Hard; self-written queries
give as many fresh, varied chat prompts as generation time allows, with no hub download
(``drafts/smollm2-135m-instruct/README.md``, round 6, has what they bought).

Queries are sampled in chunks of ``gen_batch_size``; each chunk (queries + greedy answers) is a
work-dir cache file, so a rerun resumes, and ``data_budget_s`` stops sampling new chunks once the
data stage has taken that long. Queries that are incomplete (no end-of-turn within
``max_self_prompt_tokens``), shorter than ``MIN_QUERY_WORDS`` words, duplicated, or that share a
word n-gram with the evaluation set (Spec-Bench, ``task_prompts.overlaps``) are dropped.
"""

from __future__ import annotations

import time

import torch

from distill import task_prompts
from distill.data import _eos_ids, encode_prompt_texts

QUERY_MARK = "\x00minedraft-query\x00"
MIN_QUERY_WORDS = 3
SEED_OFFSET = 7000


def pre_query_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's text starts (system turn included).

    Raises ValueError when the template does not place the user text verbatim.
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUERY_MARK}], tokenize=False)
    if QUERY_MARK not in text:
        raise ValueError("the chat template does not contain the user text verbatim; no pre-query template")
    return list(tokenizer(text[:text.index(QUERY_MARK)], add_special_tokens=False).input_ids)


@torch.no_grad()
def sample_queries(model, tokenizer, num: int, max_tokens: int, temperature: float, end_ids: tuple[int, ...],
                   pad_id: int, seed: int) -> list[str]:
    """``num`` sampled user queries (decoded, stripped; ``""`` for one without an end id).

    One batched ``generate`` from the pre-query template; ``end_ids``: ids that end a user turn
    (the target's EOS ids, e.g. ``<|im_end|>``).
    """
    pre = torch.tensor([pre_query_ids(tokenizer)] * num, device=model.device)
    torch.manual_seed(seed)
    out = model.generate(input_ids=pre, attention_mask=torch.ones_like(pre), max_new_tokens=max_tokens,
                         do_sample=True, temperature=temperature, top_p=None, top_k=None,
                         eos_token_id=list(end_ids), pad_token_id=pad_id)[:, pre.shape[1]:].tolist()
    texts = []
    for row in out:
        cut = next((i for i, t in enumerate(row) if t in end_ids), None)
        texts.append("" if cut is None else tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return texts


def keep_queries(texts: list[str], excluded: task_prompts.EvalNgrams, seen: set[str]) -> list[str]:
    """Texts worth answering: complete, ``>= MIN_QUERY_WORDS`` words, new (case-insensitive; ``seen``
    is updated) and sharing no n-gram with the evaluation set."""
    kept = []
    for text in texts:
        key = _query_key(text)
        if len(key.split()) < MIN_QUERY_WORDS or key in seen or task_prompts.overlaps(text, excluded):
            continue
        seen.add(key)
        kept.append(text)
    return kept


def _query_key(text: str) -> str:
    """Case- and whitespace-insensitive identity of a query (the duplicate check)."""
    return " ".join(text.lower().split())


def build_self_stage(cfg, model, tokenizer, excluded: task_prompts.EvalNgrams, answer, cached,
                     t0: float) -> tuple[list, dict]:
    """Self-prompt training pairs and a summary.

    Args:
        cfg: ``DistillConfig`` (num_self_prompts, gen_batch_size, max_self_prompt_tokens,
            self_prompt_temperature, max_prompt_tokens, data_budget_s, seed).
        model, tokenizer: the target.
        excluded: evaluation-set n-grams (``task_prompts.eval_ngrams``).
        answer: ``(prompt ids list) -> [(prompt ids, response ids)]``, the target's greedy answers.
        cached: ``(file name, make) -> value``, the work-dir cache.
        t0: ``time.perf_counter()`` at the start of the run (for ``data_budget_s``).
    Returns: (pairs with a non-empty response, summary dict).
    """
    end_ids = _eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
    seen: set[str] = set()
    pairs, num_sampled, num_chunks = [], 0, -(-cfg.num_self_prompts // cfg.gen_batch_size)
    for chunk in range(num_chunks):
        is_out_of_time = 0 < cfg.data_budget_s < time.perf_counter() - t0

        def make(chunk=chunk):
            num = min(cfg.gen_batch_size, cfg.num_self_prompts - chunk * cfg.gen_batch_size)
            texts = sample_queries(model, tokenizer, num, cfg.max_self_prompt_tokens, cfg.self_prompt_temperature,
                                   end_ids, pad, cfg.seed + SEED_OFFSET + chunk)
            kept = keep_queries(texts, excluded, seen)
            encoded = encode_prompt_texts(tokenizer, kept, cfg.max_prompt_tokens)
            return {"num_sampled": len(texts), "queries": [q for q, _ in encoded],
                    "pairs": answer([ids for _, ids in encoded])}

        value = cached(f"self{chunk}.pt", make, skip=is_out_of_time)
        if value is None:
            break
        seen.update(map(_query_key, value["queries"]))
        num_sampled += value["num_sampled"]
        pairs += [p for p in value["pairs"] if p[1]]
    summary = {"num_self_prompts_sampled": num_sampled, "num_self_prompts_kept": len(pairs),
               "self_prompt_method": "Magpie (Xu et al. 2024, arXiv 2406.08464): target-sampled user queries"}
    return pairs, summary
