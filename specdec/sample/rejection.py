"""Rejection sampler for speculative decoding (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1;
Chen et al. 2023, arXiv 2302.01318, Alg. 2), batched, with per-request generators.

Terms (as in vLLM's ``RejectionSampler``):

- *accepted tokens*: the draft tokens d_1..d_a kept. Draft token d_i is accepted with
  probability ``min(1, p_i(d_i) / q_i(d_i))``, where p_i is the target distribution and q_i the
  draft distribution at position i; the first rejection stops the row.
- *recovered token*: at the first rejected position i, a token sampled from the residual
  distribution ``norm(max(0, p_i - q_i))``; it replaces d_i.
- *bonus token*: when all k draft tokens are accepted, one extra token sampled from p_{k+1}.

Ragged rows: ``num_draft_tokens[i] = k_i`` (0 <= k_i <= k) gives row i its own number of draft
tokens; positions ``>= k_i`` of ``draft_token_ids`` / ``draft_probs`` / ``target_probs`` are
padding and never read (any values). Row i's acceptance chain stops at k_i, and when all k_i
drafts are accepted its bonus token is sampled from ``target_probs[i, k_i]`` (p_{k_i+1}). A
ragged row gives exactly the result of the rectangular call on that row truncated to k_i
columns (same tokens, same generator consumption). Losslessness holds for every k_i and any
draft (Leviathan et al. 2023, Theorem 1, applied per row).

So each row commits ``num_accepted + 1`` tokens: the accepted drafts then one recovered or bonus
token, and its output is distributed exactly as the target model sampling alone.
Greedy rows (temperature 0) accept while ``d_i == argmax p_i`` and then emit the target argmax.

Randomness: a sampled row i consumes, from its own generator, exactly k_i + 1 uniform draws
per call (k_i = k without ``num_draft_tokens``): draws 0..k_i-1 are the acceptance tests of
positions 1..k_i, draw k_i locates the recovered or bonus token (inverse transform sampling),
whatever is accepted; a greedy row consumes nothing. The draws depend only on the row's own
k_i, never on the batch's k or on other rows, so a seeded request gets the same tokens alone or
in any batch, padded or not.
"""

from __future__ import annotations

import torch

from specdec.sample.sampling import inverse_cdf_sample, uniform_noise

PLACEHOLDER_TOKEN_ID = -1
"""Pads ``output_token_ids`` past the committed tokens of a row (and may pad draft rows)."""


def _check_shapes(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                  target_probs: torch.Tensor, is_greedy: torch.Tensor,
                  generators: list[torch.Generator]) -> None:
    """Raise ValueError unless the arguments have the documented shapes."""
    if draft_token_ids.dim() != 2 or draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids must be int64 [b, k], got "
                         f"{draft_token_ids.dtype} {tuple(draft_token_ids.shape)}")
    batch_size, k = draft_token_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch_size, k + 1):
        raise ValueError(f"target_probs must be [{batch_size}, {k + 1}, V], "
                         f"got {tuple(target_probs.shape)}")
    vocab_size = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch_size, k, vocab_size):
        raise ValueError(f"draft_probs must be [{batch_size}, {k}, {vocab_size}], "
                         f"got {tuple(draft_probs.shape)}")
    if tuple(is_greedy.shape) != (batch_size,) or is_greedy.dtype != torch.bool:
        raise ValueError(f"is_greedy must be bool [{batch_size}], got "
                         f"{is_greedy.dtype} {tuple(is_greedy.shape)}")
    if len(generators) != batch_size:
        raise ValueError(f"need {batch_size} generators, got {len(generators)}")


def _row_lengths(num_draft_tokens: torch.Tensor | None, draft_token_ids: torch.Tensor,
                 vocab_size: int) -> torch.Tensor:
    """[b] int64 k_i of each row (k for every row when ``num_draft_tokens`` is None), checked;
    also checks that the real draft tokens (positions < k_i) lie in [0, V)."""
    batch_size, k = draft_token_ids.shape
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((batch_size,), k, dtype=torch.int64)
    elif (num_draft_tokens.dim() != 1 or num_draft_tokens.shape[0] != batch_size
          or num_draft_tokens.dtype != torch.int64):
        raise ValueError(f"num_draft_tokens must be int64 [{batch_size}], got "
                         f"{num_draft_tokens.dtype} {tuple(num_draft_tokens.shape)}")
    elif batch_size and (int(num_draft_tokens.min()) < 0 or int(num_draft_tokens.max()) > k):
        raise ValueError(f"num_draft_tokens must lie in [0, k={k}], got {num_draft_tokens.tolist()}")
    lengths = num_draft_tokens.to(draft_token_ids.device)
    is_real = _real_positions(lengths, k)
    real_ids = draft_token_ids[is_real]
    if real_ids.numel() and (int(real_ids.min()) < 0 or int(real_ids.max()) >= vocab_size):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab_size})")
    return lengths


def _real_positions(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[b, k] bool: True at the positions < k_i of each row (its real draft tokens)."""
    return torch.arange(k, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def _draw_noise(is_greedy: torch.Tensor, generators: list[torch.Generator], lengths: list[int],
                k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row k_i + 1 uniforms of its generator (module docstring): ([b, k] float64 acceptance
    draws, zero past k_i; [b] float64 final-token draws). Greedy rows draw nothing (zeros)."""
    tests = torch.zeros(len(generators), k, dtype=torch.float64)
    finals = torch.zeros(len(generators), dtype=torch.float64)
    for row, (generator, length) in enumerate(zip(generators, lengths)):
        if not bool(is_greedy[row]):
            draws = uniform_noise(length + 1, generator)
            tests[row, :length] = draws[:length]
            finals[row] = draws[length]
    return tests.to(device), finals.to(device)


def _accept_mask(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, is_greedy: torch.Tensor,
                 uniforms: torch.Tensor, is_real: torch.Tensor) -> torch.Tensor:
    """[b, k] bool: is each draft token accepted on its own (before the first-rejection cut);
    False at padded positions, so a row's chain stops at its k_i."""
    k = draft_token_ids.shape[1]
    index = draft_token_ids.unsqueeze(-1)
    p_draft = target_probs[:, :k].gather(-1, index).squeeze(-1).to(torch.float64)
    if draft_probs is None:  # deterministic drafter: q is one-hot on the draft token
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, index).squeeze(-1).to(torch.float64)
    # u < p/q written without division: q = 0 < p accepts, p = 0 never accepts.
    sampled_accept = uniforms * q_draft < p_draft
    greedy_accept = draft_token_ids == target_probs[:, :k].argmax(dim=-1)
    return torch.where(is_greedy.unsqueeze(-1), greedy_accept, sampled_accept) & is_real


def _final_distribution(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, num_accepted: torch.Tensor,
                        lengths: torch.Tensor) -> torch.Tensor:
    """[b, V] unnormalised distribution of the recovered (a < k_i: residual of p_a and q_a) or
    bonus (a == k_i: p_{k_i+1} itself) token."""
    batch_size, k = draft_token_ids.shape
    rows = torch.arange(batch_size, device=target_probs.device)
    p_final = target_probs[rows, num_accepted].to(torch.float64)
    if k == 0:
        return p_final
    at = num_accepted.clamp(max=k - 1)                    # position of the rejected draft
    if draft_probs is None:
        q_final = torch.zeros_like(p_final)
        q_final[rows, draft_token_ids[rows, at]] = 1.0
    else:
        q_final = draft_probs[rows, at].to(torch.float64)
    is_bonus = (num_accepted == lengths).unsqueeze(-1)
    residual = (p_final - torch.where(is_bonus, 0.0, q_final)).clamp_(min=0.0)
    # p == q exactly means acceptance was certain; guard rounding with p itself.
    is_empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    return torch.where(is_empty, p_final, residual)


def rejection_sample(
    # [b, k] int64: draft tokens d_1..d_k per request (positions >= num_draft_tokens[i]: padding)
    draft_token_ids: torch.Tensor,
    # [b, k, V] float: draft distributions q_1..q_k the drafts were sampled from; None means
    # a deterministic drafter (q one-hot on d_i), e.g. an all-greedy batch
    draft_probs: torch.Tensor | None,
    # [b, k + 1, V] float: target distributions p_1..p_{k+1} (after the same processors as q)
    target_probs: torch.Tensor,
    # [b] bool: rows with temperature 0
    is_greedy: torch.Tensor,
    # b per-request generators (CPU), consumed as described in the module docstring
    generators: list[torch.Generator],
    # [b] int64 in [0, k]: k_i, the number of real draft tokens of each row; None: k for all
    num_draft_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify k_i draft tokens per request against the target model (Leviathan et al. 2023,
    Alg. 1; lossless for any draft and any k_i by their Theorem 1).

    Returns:
        output_token_ids: [b, k + 1] int64: row i holds its ``num_accepted[i]`` accepted draft
            tokens, then the recovered or bonus token, then ``PLACEHOLDER_TOKEN_ID`` padding.
        num_accepted: [b] int64 number of accepted draft tokens, in [0, k_i].

    Raises:
        ValueError: when a shape, dtype, generator count, token id or ``num_draft_tokens``
            (shape, dtype, value outside [0, k]) is inconsistent.
    """
    _check_shapes(draft_token_ids, draft_probs, target_probs, is_greedy, generators)
    batch_size, k = draft_token_ids.shape
    device = target_probs.device
    lengths = _row_lengths(num_draft_tokens, draft_token_ids, target_probs.shape[2]).to(device)
    is_real = _real_positions(lengths, k)
    tests, finals = _draw_noise(is_greedy, generators, lengths.tolist(), k, device)
    safe_ids = torch.where(is_real, draft_token_ids, 0)       # padding may hold any id
    accepted = _accept_mask(safe_ids, draft_probs, target_probs, is_greedy, tests, is_real)
    num_accepted = accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    final = _final_distribution(safe_ids, draft_probs, target_probs, num_accepted, lengths)
    rows = torch.arange(batch_size, device=device)
    greedy_token = target_probs[rows, num_accepted].argmax(dim=-1)
    final_token = torch.where(is_greedy, greedy_token, inverse_cdf_sample(final, finals))
    positions = torch.arange(k + 1, device=device).unsqueeze(0)
    output = torch.full((batch_size, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                        device=device)
    output[:, :k] = torch.where(positions[:, :k] < num_accepted.unsqueeze(-1),
                                draft_token_ids, PLACEHOLDER_TOKEN_ID)
    output[rows, num_accepted] = final_token
    return output, num_accepted
