"""Online step-cost and acceptance estimates for adaptive speculation (torch-free).

Used by ``coordinator.adaptive`` (choice of k), ``coordinator.auto_mode`` (choice of mode) and
``coordinator.balancer`` (placement of new requests). Every estimate is an exponentially decayed
sum, so it follows load changes within a few dozen steps.

Cost model (times in ms, measured by the engines: ``DraftResponse.draft_ms``,
``VerifyResponse.verify_ms``):

- drafting k tokens for n requests runs k sequential draft forwards of n rows:
  ``t_draft(n, k) = k * (c_d + d_d * n)``;
- verifying n requests with k draft tokens each: one fit per k, linear in the rows,
  ``t_verify(n, k) = a_k + b_k * n``, each aged by every Verify call (of any k) since its last
  observation, so a k measured again after a load change is not outvoted by its stale past. Rows and draft positions are kept apart because they cost
  differently: on the 2-core CPU of BENCHMARKS.md a verify of 4 rows cost 180 ms at k = 1 and
  175 ms at k = 4 (flat in k) but 92 ms for 1 row (steep in n); one fit over ``n * (k + 1)``
  positions mixed the two and predicted a steep growth in k, so adaptive k chose k = 1.
  A k not measured yet is predicted from the measured ones: linearly between two, linearly
  (slope >= 0) beyond the two nearest on one side (below them never under the share of the
  positions, ``t(k0) * (k + 1) / (k0 + 1)``), flat when only one k was measured (the optimistic
  guess; ``coordinator.adaptive`` explores neighbouring k to correct it).
A verifier that is memory-bound (GPU, small batch) is flat in k; a compute-bound one grows in k
as fast as in n: then every draft token costs as much as a decoded token, which is when
speculation stops paying off (MineDraft paper §7, limits; Leviathan et al. 2023, §3.4).

Acceptance: with per-token acceptance probability alpha (Leviathan et al. 2023, §3.1), a draft of
k tokens yields ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens per verify (accepted + the recovered or
bonus token). Each verified draft is a run of accepted tokens ended by one rejection (or by its
end), so the maximum-likelihood estimate is ``alpha = accepted / (accepted + rejections)``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_VARIANCE = 1e-9  # below it a fit has no slope information (LinearFit.predict)
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


def critical_ms(t_draft: float, t_verify: float, is_parallel: bool) -> float:
    """Engine compute on a step's critical path (ms): the longer of draft and verify when they
    overlap (psd), else their sum (sd; ``t_draft`` 0 in ar)."""
    return max(t_draft, t_verify) if is_parallel else t_draft + t_verify


class LinearFit:
    """Decayed least-squares fit ``y = a + b * x`` with ``a, b >= 0``.

    With one distinct x so far (no slope information) it predicts the cheapest line with
    ``a, b >= 0`` through the mean point: flat above it, proportional below it (the optimistic
    guess: a batch size never measured looks cheap, so it gets tried and measured;
    ``StepCostModel`` borrows a slope from another fit where one has it).
    """

    def __init__(self, decay: float = DEFAULT_DECAY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay: must be in (0, 1), got {decay}")
        self.decay = decay
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._summary: tuple[bool, tuple[float, float], tuple[float, float]] | None = None  # per observation

    @property
    def is_known(self) -> bool:
        """Whether at least one observation was made."""
        return self._sw > 0.0

    def observe(self, x: float, y: float, num_periods: int = 1) -> None:
        """Add one (x, y) point; older points are weighted down by ``decay ** num_periods``
        (``num_periods``: observations of the whole model since this fit's last one, >= 1)."""
        d = self.decay ** max(num_periods, 1)
        self._sw, self._sx, self._sy = d * self._sw + 1.0, d * self._sx + x, d * self._sy + y
        self._sxx, self._sxy = d * self._sxx + x * x, d * self._sxy + x * y
        self._summary = None

    @property
    def mean_point(self) -> tuple[float, float]:
        """Weighted means ``(x, y)`` of the observations; ``(0, 0)`` before any."""
        return self._summarise()[1]

    @property
    def has_slope(self) -> bool:
        """Whether the observations span more than one x (so ``b`` is measured, not assumed)."""
        return self._summarise()[0]

    @property
    def weight(self) -> float:
        """Decayed number of observations."""
        return self._sw

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)`` of the current fit; ``(0, 0)`` before any observation."""
        return self._summarise()[2]

    def _summarise(self) -> tuple[bool, tuple[float, float], tuple[float, float]]:
        """(has_slope, mean point, coefficients), computed once per observation (the policies ask
        for them hundreds of times per step)."""
        if self._summary is None:
            self._summary = self._compute_summary()
        return self._summary

    def _compute_summary(self) -> tuple[bool, tuple[float, float], tuple[float, float]]:
        if not self.is_known:
            return False, (0.0, 0.0), (0.0, 0.0)
        mean_x, mean_y = self._sx / self._sw, self._sy / self._sw
        var_x = self._sxx / self._sw - mean_x * mean_x
        has_slope = var_x > MIN_VARIANCE * max(1.0, mean_x * mean_x)
        if not has_slope:
            return False, (mean_x, mean_y), (max(mean_y, 0.0), 0.0)
        b = (self._sxy / self._sw - mean_x * mean_y) / var_x
        if b < 0.0:  # noise: cost does not fall with work; use the mean
            return True, (mean_x, mean_y), (max(mean_y, 0.0), 0.0)
        a = mean_y - b * mean_x
        if a < 0.0:  # refit through the origin
            return True, (mean_x, mean_y), (0.0, self._sxy / self._sxx if self._sxx > 0 else 0.0)
        return True, (mean_x, mean_y), (a, b)

    def predict(self, x: float) -> float:
        if self.is_known and not self.has_slope:
            mean_x, mean_y = self.mean_point
            return max(mean_y, 0.0) * (min(x / mean_x, 1.0) if mean_x > 0 else 1.0)
        a, b = self.coefficients()
        return a + b * x


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted draft tokens and rejections; ``alpha`` is their MLE ratio
    blended with a prior (``prior_alpha`` worth ``prior_weight`` tokens) so a new request starts
    from the batch's figure rather than from nothing. The prior decays with every observation
    like the counts do (the counts saturate at ``1 / (1 - decay)`` observations; a prior that did
    not decay would hold alpha near ``prior_alpha * prior_weight / 10`` when every draft is rejected)."""

    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = DEFAULT_DECAY
    num_accepted: float = 0.0
    num_rejected: float = 0.0
    num_observed: int = 0

    def observe(self, k: int, num_accepted: int) -> None:
        """One verified draft of ``k`` tokens of which ``num_accepted`` were accepted (0..k)."""
        self.observe_call([(k, num_accepted)])

    def observe_call(self, drafts: list[tuple[int, int]]) -> None:
        """The verified drafts ``(k, num_accepted)`` of one Verify call, aged together: the past
        decays once per call, so a batch estimate remembers about ``1 / (1 - decay)`` calls
        whatever the batch size (aged per draft, 16 rows would leave it less than one call)."""
        drafts = [(k, a) for k, a in drafts if k > 0]
        if not drafts:
            return
        self.num_accepted = self.decay * self.num_accepted + sum(a for _, a in drafts)
        self.num_rejected = self.decay * self.num_rejected + sum(1.0 for k, a in drafts if a < k)
        self.num_observed += 1

    @property
    def alpha(self) -> float:
        """Estimated per-token acceptance probability in [0, 1]."""
        prior_weight = self.prior_weight * self.decay ** self.num_observed
        total = self.num_accepted + self.num_rejected + prior_weight
        return (self.num_accepted + self.prior_alpha * prior_weight) / total if total > 0 else self.prior_alpha


class StepCostModel:
    """``t_draft(n, k)`` and ``t_verify(n, k)`` (ms) from measured engine times (module docstring)."""

    def __init__(self, decay: float = DEFAULT_DECAY) -> None:
        self.decay = decay
        self.draft_per_forward = LinearFit(decay)  # ms per draft forward vs rows n
        self.verify_by_k: dict[int, LinearFit] = {}  # k -> ms per verify call vs rows n
        self.num_draft_calls = 0  # Draft calls observed (paces exploration in coordinator.adaptive)
        self.num_verify_calls = 0
        self._last_verify_call: dict[int, int] = {}  # k -> num_verify_calls at its last observation
        self._overhead = LinearFit(decay)  # its decayed mean: ms of a step beyond its critical compute

    @property
    def is_known(self) -> bool:
        """Both engines have been timed at least once."""
        return self.draft_per_forward.is_known and bool(self.verify_by_k)

    def observe_draft(self, num_requests: int, k: int, draft_ms: float) -> None:
        """One Draft call of ``k`` tokens for ``num_requests`` rows that took ``draft_ms``."""
        if num_requests > 0 and k > 0:
            self.num_draft_calls += 1
            self.draft_per_forward.observe(num_requests, draft_ms / k)

    def observe_verify(self, num_requests: int, k: int, verify_ms: float) -> None:
        """One Verify call of ``num_requests`` rows with ``k`` draft tokens each (0: decode)."""
        if num_requests > 0 and k >= 0:
            self.num_verify_calls += 1
            age = self.num_verify_calls - self._last_verify_call.get(k, self.num_verify_calls - 1)
            self._last_verify_call[k] = self.num_verify_calls
            self.verify_by_k.setdefault(k, LinearFit(self.decay)).observe(num_requests, verify_ms, age)

    def observe_step(self, wall_ms: float, critical_ms: float) -> None:
        """One coordinator step of ``wall_ms`` whose engine compute on the critical path took
        ``critical_ms`` (psd: the longer of the overlapped draft and verify; sd: their sum)."""
        self._overhead.observe(0.0, max(wall_ms - critical_ms, 0.0))

    @property
    def overhead_ms(self) -> float:
        """Smoothed fixed cost of a step beyond the engines' compute (RPCs, the coordinator's own
        work), ms; 0 before any step. It does not grow with k, so it favours longer drafts."""
        return self._overhead.mean_point[1]  # decayed mean; (0, 0) before any step

    def draft_ms(self, num_requests: int, k: int) -> float:
        return k * self.draft_per_forward.predict(num_requests) if num_requests and k else 0.0

    def verify_ms(self, num_requests: int, k: int) -> float:
        """Predicted ms of one Verify call (module docstring: measured k, else from neighbours)."""
        if not num_requests or not self.verify_by_k:
            return 0.0
        if k in self.verify_by_k:
            return self._at(k, num_requests)
        seen = sorted(self.verify_by_k)
        lower, upper = [s for s in seen if s < k], [s for s in seen if s > k]
        if lower and upper:
            return self._line(lower[-1], upper[0], num_requests, k)
        if len(lower) >= 2:
            return self._line(lower[-2], lower[-1], num_requests, k)
        if len(upper) >= 2:
            floor = self._at(upper[0], num_requests) * (k + 1) / (upper[0] + 1)  # affine in positions, a >= 0
            return max(self._line(upper[0], upper[1], num_requests, k), floor)
        return self._at((lower or upper)[0], num_requests)

    def _at(self, k: int, num_requests: int) -> float:
        """The k fit at n rows; a fit that saw one n only takes the row slope of the most
        observed fit that has one (rows cost about the same whatever k), else stays flat."""
        fit = self.verify_by_k[k]
        sloped = [other for other in self.verify_by_k.values() if other.has_slope]
        if fit.has_slope or not sloped:
            return fit.predict(num_requests)
        _, slope = max(sloped, key=lambda other: other.weight).coefficients()
        mean_x, mean_y = fit.mean_point
        return max(mean_y + slope * (num_requests - mean_x), 0.0)

    def _line(self, k0: int, k1: int, num_requests: int, k: int) -> float:
        """Through the predictions at k0 < k1, slope in k clamped >= 0, value >= 0."""
        y0, y1 = self._at(k0, num_requests), self._at(k1, num_requests)
        slope = max((y1 - y0) / (k1 - k0), 0.0)
        return max(y0 + slope * (k - k0), 0.0)
