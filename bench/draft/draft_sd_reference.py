"""Reference pieces of ``bench/draft/draft_acceptance.py``: a plain speculative-decoding loop with HF
KV caches (the cross-check of the simulated acceptance), the decode-forward timing, and the
mapping of a reduced-vocabulary (FR-Spec) draft's logits into the target vocabulary."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from specdec.models.draft_format import draft_vocab_ids


@torch.no_grad()
def sd_accepted_counts(target, draft, prompt: list[int], k: int, temperature: float, max_new: int,
                       gen: torch.Generator) -> list[int]:
    """Cross-check: real speculative decoding (draft k, verify, rejection sampling of Leviathan et
    al. 2023, Alg. 1) with KV caches for one prompt; returns the accepted count of each step."""
    t_cache, d_cache, seq, counts = DynamicCache(), DynamicCache(), list(prompt), []
    target(torch.tensor([seq[:-1]]), past_key_values=t_cache, use_cache=True)
    while len(seq) - len(prompt) < max_new:
        drafts, q_rows, feed = [], [], seq[d_cache.get_seq_length():]
        for _ in range(k):
            logits = draft(torch.tensor([feed]), past_key_values=d_cache, use_cache=True).logits[0, -1]
            q = probs(target_vocab_logits(draft, logits, target.config.vocab_size), temperature)
            tok = int(q.argmax()) if temperature == 0 else int(torch.multinomial(q, 1, generator=gen))
            drafts, q_rows, feed = drafts + [tok], q_rows + [q], [tok]
        logits = target(torch.tensor([[seq[-1]] + drafts]), past_key_values=t_cache, use_cache=True).logits[0]
        p_rows = [probs(row, temperature) for row in logits]
        accepted, new_tok = 0, None
        for i, tok in enumerate(drafts):
            ratio = 1.0 if temperature == 0 and int(p_rows[i].argmax()) == tok else (
                0.0 if temperature == 0 else float(p_rows[i][tok] / q_rows[i][tok]))
            if float(torch.rand(1, generator=gen)) >= min(1.0, ratio):
                residual = (p_rows[i] - q_rows[i]).clamp_min(0)
                new_tok = _sample(residual / residual.sum() if temperature > 0 else p_rows[i], temperature, gen)
                break
            accepted += 1
        if new_tok is None:
            new_tok = _sample(p_rows[k], temperature, gen)
        seq += drafts[:accepted] + [new_tok]
        counts.append(accepted)
        _crop_to(t_cache, len(seq) - 1)
        _crop_to(d_cache, len(seq) - 1)
    return counts


def target_vocab_logits(draft, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits ``[..., N]`` of a reduced-vocabulary draft -> ``[..., vocab_size]`` (-inf outside)."""
    ids = draft_vocab_ids(draft)
    if ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, ids, logits)


def _crop_to(cache: DynamicCache, length: int) -> None:
    """KV rollback to ``length`` tokens (no-op when the cache is not longer)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / (temperature or 1.0), -1)


def _sample(probs: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    return int(probs.argmax()) if temperature == 0 else int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def forward_ms(model, batch: int, context: int, num_iters: int) -> float:
    """Median wall time (ms) of one single-token decode forward over a ``context``-token KV cache."""
    cache = DynamicCache()
    ids = torch.randint(0, model.config.vocab_size, (batch, context))
    model(ids, past_key_values=cache, use_cache=True)
    times = []
    step = torch.randint(0, model.config.vocab_size, (batch, 1))
    for _ in range(num_iters):
        t0 = time.perf_counter()
        model(step, past_key_values=cache, use_cache=True)
        times.append((time.perf_counter() - t0) * 1e3)
        cache.crop(-1)  # drop the token just appended
    return statistics.median(times)
