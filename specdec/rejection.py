"""Rejection sampler for speculative decoding (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1;
Chen et al. 2023, arXiv 2302.01318, Alg. 2), batched, with per-request generators.

Terms (as in vLLM's ``RejectionSampler``):

- *accepted tokens*: the draft tokens d_1..d_a kept. Draft token d_i is accepted with
  probability ``min(1, p_i(d_i) / q_i(d_i))``, where p_i is the target distribution and q_i the
  draft distribution at position i; the first rejection stops the row.
- *recovered token*: at the first rejected position i, a token sampled from the residual
  distribution ``norm(max(0, p_i - q_i))``; it replaces d_i.
- *bonus token*: when all k draft tokens are accepted, one extra token sampled from p_{k+1}.

So each row commits ``num_accepted + 1`` tokens: the accepted drafts then one recovered or bonus
token, and its output is distributed exactly as the target model sampling alone.
Greedy rows (temperature 0) accept while ``d_i == argmax p_i`` and then emit the target argmax.

Randomness: a sampled row consumes, from its own generator, exactly k + 1 uniform draws per call
(k acceptance tests, then one for the recovered or bonus token, drawn by inverse transform
sampling), whatever is accepted; a greedy row consumes nothing. So a seeded
request gets the same tokens alone or in any batch.
"""

from __future__ import annotations

import torch

from specdec.sampling import inverse_cdf_sample, uniform_noise

PLACEHOLDER_TOKEN_ID = -1
"""Pads ``output_token_ids`` past the committed tokens of a row."""


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
    if k > 0 and (draft_token_ids.min() < 0 or draft_token_ids.max() >= vocab_size):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab_size})")


def _draw_noise(is_greedy: torch.Tensor, generators: list[torch.Generator], k: int,
                device: torch.device) -> torch.Tensor:
    """[b, k + 1] float64 uniforms per row: k acceptance tests, then the final token's draw
    (zeros for greedy rows, which draw nothing)."""
    uniforms = torch.zeros(len(generators), k + 1, dtype=torch.float64)
    for row, generator in enumerate(generators):
        if not bool(is_greedy[row]):
            uniforms[row] = uniform_noise(k + 1, generator)
    return uniforms.to(device)


def _accept_mask(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, is_greedy: torch.Tensor,
                 uniforms: torch.Tensor) -> torch.Tensor:
    """[b, k] bool: is each draft token accepted on its own (before the first-rejection cut)."""
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
    return torch.where(is_greedy.unsqueeze(-1), greedy_accept, sampled_accept)


def _final_distribution(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """[b, V] unnormalised distribution of the recovered (a < k) or bonus (a == k) token."""
    batch_size, k = draft_token_ids.shape
    rows = torch.arange(batch_size, device=target_probs.device)
    p_final = target_probs[rows, num_accepted].to(torch.float64)
    if k == 0:
        return p_final
    if draft_probs is None:
        q_steps = torch.zeros_like(target_probs[:, :k], dtype=torch.float64)
        q_steps.scatter_(-1, draft_token_ids.unsqueeze(-1), 1.0)
    else:
        q_steps = draft_probs.to(torch.float64)
    q_padded = torch.cat([q_steps, torch.zeros_like(p_final).unsqueeze(1)], dim=1)
    residual = (p_final - q_padded[rows, num_accepted]).clamp_(min=0.0)
    # p == q exactly means acceptance was certain; guard rounding with p itself.
    is_empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    return torch.where(is_empty, p_final, residual)


def rejection_sample(
    # [b, k] int64: draft tokens d_1..d_k per request
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify k draft tokens per request against the target model (Leviathan et al. 2023, Alg. 1).

    Returns:
        output_token_ids: [b, k + 1] int64: row i holds its ``num_accepted[i]`` accepted draft
            tokens, then the recovered or bonus token, then ``PLACEHOLDER_TOKEN_ID`` padding.
        num_accepted: [b] int64 number of accepted draft tokens, in [0, k].

    Raises:
        ValueError: when a shape, dtype, generator count or token id is inconsistent.
    """
    _check_shapes(draft_token_ids, draft_probs, target_probs, is_greedy, generators)
    batch_size, k = draft_token_ids.shape
    device = target_probs.device
    uniforms = _draw_noise(is_greedy, generators, k, device)
    accepted = _accept_mask(draft_token_ids, draft_probs, target_probs, is_greedy, uniforms[:, :k])
    num_accepted = accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    final = _final_distribution(draft_token_ids, draft_probs, target_probs, num_accepted)
    rows = torch.arange(batch_size, device=device)
    greedy_token = target_probs[rows, num_accepted].argmax(dim=-1)
    final_token = torch.where(is_greedy, greedy_token, inverse_cdf_sample(final, uniforms[:, k]))
    positions = torch.arange(k + 1, device=device).unsqueeze(0)
    output = torch.full((batch_size, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                        device=device)
    output[:, :k] = torch.where(positions[:, :k] < num_accepted.unsqueeze(-1),
                                draft_token_ids, PLACEHOLDER_TOKEN_ID)
    output[rows, num_accepted] = final_token
    return output, num_accepted
