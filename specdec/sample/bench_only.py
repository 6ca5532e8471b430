"""Benchmark-only options and their labels (torch-free).

``--bench-fixed-acceptance P`` makes the verifier accept each draft token with probability P
instead of running the rejection sampler (``specdec.sample.fixed_acceptance``), so that randomly
initialised models of realistic shape (``random:<preset>`` model specs) do the draft and verify
work of a real deployment at a chosen acceptance rate (issue 8: the paper-scale run). It CHANGES
THE OUTPUT DISTRIBUTION: it is off unless given explicitly, the verifier logs it loudly at
start, reports it in ``EngineInfo.model``, the gateway's ListModels shows it next to the draft,
and every benchmark output that used it carries ``fixed_acceptance_label(P)``.
"""
from __future__ import annotations

import math

FIXED_ACCEPTANCE_FLAG = "--bench-fixed-acceptance"


def fixed_acceptance_label(acceptance_prob: float) -> str:
    """``"BENCHMARK-ONLY fixed acceptance 0.7"``: the label every output of such a run carries."""
    return f"BENCHMARK-ONLY fixed acceptance {acceptance_prob:g}"


def check_acceptance_prob(acceptance_prob: float, name: str = FIXED_ACCEPTANCE_FLAG) -> float:
    """Returns ``acceptance_prob`` as a float.

    Raises:
        ValueError: naming ``name`` unless it is a finite number in [0, 1].
    """
    try:
        value = float(acceptance_prob)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a number in [0, 1], got {acceptance_prob!r}") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name}: must be in [0, 1], got {acceptance_prob!r}")
    return value


def expected_mean_acceptance_length(acceptance_prob: float, k: int) -> float:
    """Tokens committed per verify step when each of k drafts is accepted with probability P
    and the first rejection ends the run: ``sum_{i=0..k} P^i = (1 - P^(k+1)) / (1 - P)``
    (Leviathan et al. 2023, eq. 1, with a fixed acceptance rate alpha = P)."""
    return float(sum(acceptance_prob ** i for i in range(k + 1)))
