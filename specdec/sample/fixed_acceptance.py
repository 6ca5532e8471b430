"""BENCHMARK-ONLY fixed acceptance: accept each draft token with a fixed probability P.

With randomly initialised models of realistic shape (``random:<preset>``, issue 8's paper-scale
run) the rejection sampler would reject almost every draft, so speculation would never run
more than one token per step. This sampler replaces it for benchmarks: draft token d_i is
accepted with probability P, independently, from a seeded benchmark generator; the first
rejection ends the run; then the target's own token is emitted at that position (argmax of
p_{a+1} for greedy rows, a sample from p_{a+1} for the others: the "recovered" token of the
real sampler but drawn from p, not the residual), or the bonus token when all k are accepted.
The per-step draft and verify work is therefore that of a real deployment while the mean
acceptance length is ``(1 - P^(k+1)) / (1 - P)`` (``specdec.sample.bench_only``).

It CHANGES THE OUTPUT DISTRIBUTION (drafts are accepted whatever the target thinks of them):
off unless the verifier gets ``--bench-fixed-acceptance P``, and labelled
``specdec.sample.bench_only.fixed_acceptance_label(P)`` wherever it is on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sample.bench_only import check_acceptance_prob
from specdec.sample.rejection import PLACEHOLDER_TOKEN_ID
from specdec.sample.sampling import make_generator, sample_from_probs

DEFAULT_BENCH_SEED = 0
_UNIFORM_DTYPE = torch.float64


@dataclass(frozen=True)
class FixedAcceptance:
    """BENCHMARK-ONLY fixed acceptance of the verifier (see module docstring).

    Attributes:
        acceptance_prob: P in [0, 1], the probability that each draft token is accepted.
        seed: seeds the benchmark generator of accept/reject draws. Tensor-parallel ranks get
            the same seed and the same commands in the same order, so they decide alike.

    Raises:
        ValueError: naming ``acceptance_prob`` (outside [0, 1] or not finite) or ``seed``.
    """

    acceptance_prob: float
    seed: int = DEFAULT_BENCH_SEED

    def __post_init__(self) -> None:
        check_acceptance_prob(self.acceptance_prob, "acceptance_prob")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: must be an int >= 0, got {self.seed!r}")

    def make_generator(self) -> torch.Generator:
        """The CPU generator the accept/reject draws come from."""
        return make_generator(self.seed)


def fixed_acceptance_sample(
    draft_token_ids: torch.Tensor,         # [b, k] int64 draft tokens d_1..d_k
    target_probs: torch.Tensor,            # [b, k + 1, V] target distributions p_1..p_{k+1}
    is_greedy: torch.Tensor,               # [b] bool: rows with temperature 0
    generators: list[torch.Generator],     # b per-request generators (final token of sampled rows)
    acceptance_prob: float,                # P in [0, 1]
    bench_generator: torch.Generator,      # CPU generator of the accept/reject draws
    num_draft_tokens: torch.Tensor | None = None,  # [b] int64 k_i in [0, k]; None: k for all
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept each draft with probability P (first rejection ends the row), then the target's token.

    Row i accepts at most its k_i drafts (positions >= k_i are padding); with all k_i accepted
    its last token comes from p_{k_i+1}. Consumes ``b * k`` uniforms of ``bench_generator`` per call, and one uniform of a sampled
    row's own generator (``specdec.sample.sampling.sample_from_probs``); greedy rows use none of theirs.

    Returns:
        output_token_ids: [b, k + 1] int64, as ``specdec.sample.rejection.rejection_sample``: the
            accepted drafts, then the target's token, then ``PLACEHOLDER_TOKEN_ID``.
        num_accepted: [b] int64 in [0, k].

    Raises:
        ValueError: inconsistent shapes or generator count, or P outside [0, 1].
    """
    acceptance_prob = check_acceptance_prob(acceptance_prob, "acceptance_prob")
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [b, k], got {tuple(draft_token_ids.shape)}")
    batch_size, k = draft_token_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch_size, k + 1):
        raise ValueError(f"target_probs must be [{batch_size}, {k + 1}, V], got {tuple(target_probs.shape)}")
    if tuple(is_greedy.shape) != (batch_size,) or len(generators) != batch_size:
        raise ValueError(f"need is_greedy [{batch_size}] and {batch_size} generators, "
                         f"got {tuple(is_greedy.shape)} and {len(generators)}")
    uniforms = torch.rand(batch_size, k, dtype=_UNIFORM_DTYPE, generator=bench_generator)
    is_accepted = uniforms < acceptance_prob
    if num_draft_tokens is not None:
        is_accepted &= torch.arange(k).unsqueeze(0) < num_draft_tokens.cpu().unsqueeze(1)
    num_accepted = is_accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)   # [b]
    rows = torch.arange(batch_size)
    final_probs = target_probs[rows.to(target_probs.device), num_accepted.to(target_probs.device)]
    final_token = sample_from_probs(final_probs, is_greedy.tolist(), generators).cpu()     # [b]
    positions = torch.arange(k + 1).unsqueeze(0)
    output = torch.where(positions[:, :k] < num_accepted.unsqueeze(-1), draft_token_ids.cpu(),
                         PLACEHOLDER_TOKEN_ID)
    output = torch.cat([output, torch.full((batch_size, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)], dim=1)
    output[rows, num_accepted] = final_token.to(torch.int64)
    return output, num_accepted
