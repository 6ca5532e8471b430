"""Adaptive number of draft tokens k (``--k-policy adaptive``; torch-free).

Source: MineDraft paper (Tang, Verma et al. 2026), §4, Lemma 2: a PSD step takes
``max(t_draft, t_verify)``, so its time per committed token is lowest when drafting and
verification take equally long; the paper fixes k and leaves adapting it as future work (§7).

Per batch (PSD batch 0 or 1, or the one ``sd`` batch of n requests) the next k maximises
expected committed tokens per unit of step time (``coordinator.cost_model``)::

    k* = argmax_{1 <= k <= k_max}  n * E(alpha, k) / T(n, k)
    T = max(t_draft(n, k), t_verify(n, k))   in psd (drafting overlaps the other batch's verify)
    T = t_draft(n, k) + t_verify(n, k)        in sd

With t_verify flat in k (memory-bound verifier) the psd optimum sits where t_draft(k) reaches
t_verify (Lemma 2); in sd it is the classic trade-off of Leviathan et al. 2023, §3.4.

Per request: a request whose drafts keep being rejected (its own acceptance estimate below
``min_request_alpha``) is not drafted at all (k = 0, verified alone), except every
``probe_every_steps`` verify steps, when it is drafted again to refresh its estimate. Between 0
and the batch's k there is no middle ground: the engines take one rectangular [batch, k] draft
tensor per call, so a smaller k for one request would save nothing and cost an extra Verify call.

Lossless: the rejection sampler is exact for any k and any draft (Leviathan et al. 2023,
Theorem 1), so changing k between steps or per request never changes the output distribution.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.cost_model import AcceptanceEstimate, StepCostModel, expected_tokens

NO_DRAFT = 0  # a request verified without draft tokens this step


class KPolicy(enum.StrEnum):
    """``fixed``: k = ``num_speculative_tokens`` always; ``adaptive``: see the module docstring."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of the adaptive policies.

    Attributes:
        decay: weight of the past per observation in every estimate, in (0, 1).
        min_request_alpha: per-token acceptance below which a request stops being drafted, [0, 1).
        probe_every_steps: a request not drafted is drafted again after this many verify steps (>= 1).
        prior_alpha: acceptance assumed before any draft was verified, (0, 1).
    """

    decay: float = 0.9
    min_request_alpha: float = 0.1
    probe_every_steps: int = 8
    prior_alpha: float = 0.6

    def __post_init__(self) -> None:
        checks = {"decay": 0.0 < self.decay < 1.0, "min_request_alpha": 0.0 <= self.min_request_alpha < 1.0,
                  "probe_every_steps": self.probe_every_steps >= 1, "prior_alpha": 0.0 < self.prior_alpha < 1.0}
        for name, is_ok in checks.items():
            if not is_ok:
                raise ValueError(f"{name}: out of range, got {getattr(self, name)!r}")


@dataclass
class _RequestRecord:
    acceptance: AcceptanceEstimate
    num_steps_undrafted: int = 0


class SpeculationStats:
    """What the adaptive policies learn online: step costs and acceptance (batch and per request)."""

    def __init__(self, cfg: AdaptiveConfig = AdaptiveConfig()) -> None:
        self.cfg = cfg
        self.cost = StepCostModel(cfg.decay)
        self.acceptance = AcceptanceEstimate(prior_alpha=cfg.prior_alpha, decay=cfg.decay)
        self._requests: dict[str, _RequestRecord] = {}

    def observe_verified(self, request_id: str, k: int, num_accepted: int) -> None:
        """A request was verified with ``k`` draft tokens (0 = none) and ``num_accepted`` accepted."""
        record = self._record(request_id)
        if k == NO_DRAFT:
            record.num_steps_undrafted += 1
            return
        record.num_steps_undrafted = 0
        record.acceptance.observe(k, num_accepted)
        self.acceptance.observe(k, num_accepted)

    def request_alpha(self, request_id: str) -> float:
        """The request's acceptance estimate (the batch's before its first verified draft)."""
        return self._record(request_id).acceptance.alpha

    def is_probe_due(self, request_id: str) -> bool:
        return self._record(request_id).num_steps_undrafted >= self.cfg.probe_every_steps

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request."""
        self._requests.pop(request_id, None)

    def _record(self, request_id: str) -> _RequestRecord:
        record = self._requests.get(request_id)
        if record is None:
            prior = min(max(self.acceptance.alpha, 1e-3), 1 - 1e-3)
            record = _RequestRecord(AcceptanceEstimate(prior_alpha=prior, prior_weight=1.0, decay=self.cfg.decay))
            self._requests[request_id] = record
        return record


class KChooser:
    """k per batch and per request under a :class:`KPolicy` (module docstring).

    Args:
        policy: ``fixed`` or ``adaptive``.
        max_k: k_max (the configured ``num_speculative_tokens``, >= 1).
        stats: the shared online estimates.
    """

    def __init__(self, policy: KPolicy | str, max_k: int, stats: SpeculationStats) -> None:
        if max_k < 1:
            raise ValueError(f"max_k: must be >= 1, got {max_k}")
        self.policy, self.max_k, self.stats = KPolicy(policy), max_k, stats

    @property
    def is_adaptive(self) -> bool:
        return self.policy == KPolicy.ADAPTIVE

    def batch_k(self, num_requests: int, is_parallel: bool) -> int:
        """k for the next draft of a batch of ``num_requests`` (``is_parallel``: psd overlap)."""
        if not self.is_adaptive or not self.stats.cost.is_known or num_requests <= 0:
            return self.max_k
        return max(range(1, self.max_k + 1), key=lambda k: self.goodput(num_requests, k, is_parallel))

    def goodput(self, num_requests: int, k: int, is_parallel: bool) -> float:
        """Expected committed tokens per ms of a step with ``num_requests`` at ``k`` (0 = ar)."""
        cost = self.stats.cost
        t_draft, t_verify = cost.draft_ms(num_requests, k), cost.verify_ms(num_requests, k)
        step_ms = max(t_draft, t_verify) if is_parallel else t_draft + t_verify
        tokens = num_requests * expected_tokens(self.stats.acceptance.alpha, k)
        return tokens / step_ms if step_ms > 0 else 0.0

    def request_k(self, request_id: str, batch_k: int) -> int:
        """``batch_k``, or :data:`NO_DRAFT` for a request whose drafts keep being rejected."""
        if not self.is_adaptive or batch_k == NO_DRAFT:
            return batch_k
        if self.stats.request_alpha(request_id) >= self.stats.cfg.min_request_alpha:
            return batch_k
        return batch_k if self.stats.is_probe_due(request_id) else NO_DRAFT
