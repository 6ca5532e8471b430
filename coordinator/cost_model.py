"""Online step-cost and acceptance estimates for adaptive speculation (torch-free).

Used by ``coordinator.adaptive`` (choice of k), ``coordinator.auto_mode`` (choice of mode) and
``coordinator.balancer`` (placement of new requests). Every estimate is an exponentially decayed
sum, so it follows load changes within a few dozen steps.

Cost model (times in ms, measured by the engines: ``DraftResponse.draft_ms``,
``VerifyResponse.verify_ms``):

- drafting k tokens for n requests runs k sequential draft forwards of n rows:
  ``t_draft(n, k) = k * (c_d + d_d * n)``;
- verifying n requests with k draft tokens each scores ``n * (k + 1)`` positions in one forward:
  ``t_verify(n, k) = a_v + b_v * n * (k + 1)``.
A verifier that is memory-bound (GPU, small batch) shows ``b_v ~ 0``; a compute-bound one shows
``a_v ~ 0``: then every draft token costs as much as a decoded token, which is when speculation
stops paying off (MineDraft paper §7, limits; Leviathan et al. 2023, §3.4).

Acceptance: with per-token acceptance probability alpha (Leviathan et al. 2023, §3.1), a draft of
k tokens yields ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens per verify (accepted + the recovered or
bonus token). Each verified draft is a run of accepted tokens ended by one rejection (or by its
end), so the maximum-likelihood estimate is ``alpha = accepted / (accepted + rejections)``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_VARIANCE = 1e-9  # below it a fit has no slope information: fall back to proportional
DEFAULT_DECAY = 0.9  # weight of the past per observation (about 10 observations of memory)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected committed tokens of one verify with k draft tokens at acceptance ``alpha``
    (Leviathan et al. 2023, eq. 1): ``(1 - alpha^(k+1)) / (1 - alpha)``; ``k + 1`` at alpha 1.

    Raises:
        ValueError: alpha outside [0, 1] or k < 0.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class LinearFit:
    """Decayed least-squares fit ``y = a + b * x`` with ``a, b >= 0``.

    With one distinct x so far (no slope information) it predicts ``y`` proportional to x
    through the origin (``b = mean_y / mean_x``), the conservative choice for a cost.
    """

    def __init__(self, decay: float = DEFAULT_DECAY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay: must be in (0, 1), got {decay}")
        self.decay = decay
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0

    @property
    def is_known(self) -> bool:
        """Whether at least one observation was made."""
        return self._sw > 0.0

    def observe(self, x: float, y: float) -> None:
        """Add one (x, y) point; older points are weighted down by ``decay``."""
        d = self.decay
        self._sw, self._sx, self._sy = d * self._sw + 1.0, d * self._sx + x, d * self._sy + y
        self._sxx, self._sxy = d * self._sxx + x * x, d * self._sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)`` of the current fit; ``(0, 0)`` before any observation."""
        if not self.is_known:
            return 0.0, 0.0
        mean_x, mean_y = self._sx / self._sw, self._sy / self._sw
        var_x = self._sxx / self._sw - mean_x * mean_x
        if var_x <= MIN_VARIANCE * max(1.0, mean_x * mean_x):
            return 0.0, (mean_y / mean_x if mean_x > 0 else 0.0)
        b = (self._sxy / self._sw - mean_x * mean_y) / var_x
        if b < 0.0:  # noise: cost does not fall with work; use the mean
            return max(mean_y, 0.0), 0.0
        a = mean_y - b * mean_x
        if a < 0.0:  # refit through the origin
            return 0.0, self._sxy / self._sxx if self._sxx > 0 else 0.0
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted draft tokens and rejections; ``alpha`` is their MLE ratio
    blended with a prior (``prior_alpha`` worth ``prior_weight`` tokens) so a new request starts
    from the batch's figure rather than from nothing."""

    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = DEFAULT_DECAY
    num_accepted: float = 0.0
    num_rejected: float = 0.0

    def observe(self, k: int, num_accepted: int) -> None:
        """One verified draft of ``k`` tokens of which ``num_accepted`` were accepted (0..k)."""
        if k <= 0:
            return
        self.num_accepted = self.decay * self.num_accepted + num_accepted
        self.num_rejected = self.decay * self.num_rejected + (1.0 if num_accepted < k else 0.0)

    @property
    def alpha(self) -> float:
        """Estimated per-token acceptance probability in [0, 1]."""
        prior_accepted = self.prior_alpha * self.prior_weight
        total = self.num_accepted + self.num_rejected + self.prior_weight
        return (self.num_accepted + prior_accepted) / total


class StepCostModel:
    """``t_draft(n, k)`` and ``t_verify(n, k)`` (ms) from measured engine times (module docstring)."""

    def __init__(self, decay: float = DEFAULT_DECAY) -> None:
        self.draft_per_forward = LinearFit(decay)  # ms per draft forward vs rows n
        self.verify = LinearFit(decay)  # ms per verify vs scored positions n * (k + 1)

    @property
    def is_known(self) -> bool:
        """Both engines have been timed at least once."""
        return self.draft_per_forward.is_known and self.verify.is_known

    def observe_draft(self, num_requests: int, k: int, draft_ms: float) -> None:
        if num_requests > 0 and k > 0:
            self.draft_per_forward.observe(num_requests, draft_ms / k)

    def observe_verify(self, num_positions: int, verify_ms: float) -> None:
        """One verify call scoring ``num_positions`` = sum over requests of (k_i + 1)."""
        if num_positions > 0:
            self.verify.observe(num_positions, verify_ms)

    def draft_ms(self, num_requests: int, k: int) -> float:
        return k * self.draft_per_forward.predict(num_requests) if num_requests and k else 0.0

    def verify_ms(self, num_requests: int, k: int) -> float:
        return self.verify.predict(num_requests * (k + 1)) if num_requests else 0.0
