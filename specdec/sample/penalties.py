"""Presence, frequency and repetition penalties, per row, for the target and the draft model.

Definitions as in vLLM (``vllm.model_executor.layers.utils.apply_penalties``) and OpenAI, on the
raw logits before temperature (so greedy decoding takes the argmax of the penalised logits):

- repetition (Keskar et al. 2019, CTRL §4.1): a token of the prompt or of the output so far gets
  ``logit / r`` when its logit is positive, else ``logit * r``;
- frequency: ``logit -= f * count``, count = the token's occurrences in the output so far;
- presence: ``logit -= p`` for every token that occurs in the output so far.

Exactness under speculation: the verifier scores ``[pending, d_1..d_k]`` in one forward, and
position j's distribution is the one the target would sample token j + 1 from *if* d_1..d_j are
accepted, so its history is the committed output plus d_1..d_j (``draft_token_ids``). The draft
model's step j uses the same history (committed output + its own d_1..d_j), so q is penalised
as p is. Rows without penalties are returned untouched, bit for bit (``specdec.sample.sampling.on_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.sample.sampling import SamplingParams, on_rows

History = tuple[Sequence[int], Sequence[int]]
"""(prompt token ids, output token ids so far) of one request, in target ids."""


def _columns(token_ids: Sequence[int], column_of: torch.Tensor | None, vocab_size: int,
             device: torch.device) -> torch.Tensor:
    """Logit columns [n] int64 of target ``token_ids``; -1 for ids with no column (outside a
    smaller draft vocabulary). ``column_of`` [max id + 1]: column of each target id, or -1."""
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    if column_of is None:
        return torch.where((ids >= 0) & (ids < vocab_size), ids, -1)
    inside = (ids >= 0) & (ids < column_of.shape[0])
    return torch.where(inside, column_of[ids.clamp(0, column_of.shape[0] - 1)], -1)


def _bincount(columns: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[V] counts of the valid (>= 0) ``columns``."""
    return torch.bincount(columns[columns >= 0], minlength=vocab_size).to(dtype)


def _draft_counts(draft_rows: list[list[int]], num_positions: int, column_of, vocab_size: int,
                  like: torch.Tensor) -> torch.Tensor:
    """[r, q, V]: at position j, the counts of d_1..d_j of each row (0 at j = 0)."""
    counts = torch.zeros(len(draft_rows), num_positions, vocab_size, dtype=like.dtype, device=like.device)
    if num_positions < 2:
        return counts
    width = num_positions - 1
    padded = [list(row[:width]) + [-1] * (width - len(row[:width])) for row in draft_rows]
    columns = torch.stack([_columns(row, column_of, vocab_size, like.device) for row in padded])  # [r, q - 1]
    is_real = (columns >= 0).to(like.dtype).unsqueeze(-1)
    counts[:, 1:].scatter_add_(-1, columns.clamp(min=0).unsqueeze(-1), is_real)
    return counts.cumsum(dim=1)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[History | None],
                    draft_token_ids: list[list[int]] | None = None,
                    vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Penalise the logits of the rows whose params have penalties (module docstring).

    Args:
        logits: [b, q, V] raw logits (float32 / float64).
        params: b sampling params.
        histories: b (prompt, output so far) pairs; may be None for rows without penalties.
        draft_token_ids: b rows of draft tokens d_1..: position j's output history is the output
            plus the row's first j tokens (positions past a short row: padding, never read).
            None: every position has the output as its history.
        vocab_ids: [V] target id of each logit column (a reduced-vocabulary draft, FR-Spec);
            None: column = token id (ids >= V have no column).

    Returns:
        [b, q, V] logits; rows without penalties are the input's values, bit for bit.
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()                          # as logits_to_probs would upcast them
    vocab_size, num_positions = logits.shape[-1], logits.shape[1]
    column_of = None
    if vocab_ids is not None:
        column_of = torch.full((int(vocab_ids.max()) + 1,), -1, dtype=torch.int64, device=logits.device)
        column_of[vocab_ids.to(logits.device)] = torch.arange(vocab_ids.shape[0], device=logits.device)

    def penalise(sub: torch.Tensor) -> torch.Tensor:
        prompts = [_columns(histories[i][0], column_of, vocab_size, sub.device) for i in rows]
        outputs = torch.stack([_bincount(_columns(histories[i][1], column_of, vocab_size, sub.device),
                                         vocab_size, sub.dtype) for i in rows])           # [r, V]
        drafts = [draft_token_ids[i] if draft_token_ids else [] for i in rows]
        counts = outputs.unsqueeze(1) + _draft_counts(drafts, num_positions, column_of, vocab_size, sub)
        in_prompt = torch.stack([_bincount(c, vocab_size, sub.dtype) > 0 for c in prompts]).unsqueeze(1)

        def column(name: str) -> torch.Tensor:                                  # [r, 1, 1]
            return torch.tensor([getattr(params[i], name) for i in rows], dtype=sub.dtype,
                                device=sub.device).view(-1, 1, 1)

        repetition = torch.where(in_prompt | (counts > 0), column("repetition_penalty"), 1.0)
        sub = torch.where(sub > 0, sub / repetition, sub * repetition)
        return sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0).to(sub.dtype)

    return on_rows(logits, rows, penalise)
