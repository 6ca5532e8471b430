"""Online step-cost and acceptance estimates for adaptive speculation (torch-free).

Used by ``coordinator.adaptive`` (choice of k), ``coordinator.auto_mode`` (choice of mode) and
``coordinator.balancer`` (placement of new requests). Every estimate is an exponentially decayed
sum, so it follows load changes within a few dozen steps.

Cost model (times in ms, measured by the engines: ``DraftResponse.draft_ms``,
``VerifyResponse.verify_ms``):

- drafting k tokens for n requests: one fit per k, linear in the rows,
  ``t_draft(n, k) = c_k + d_k * n``. A Draft call is not k times one forward: vLLM's drafter
  (``specdec.vllm_backend.draft``) admits its rows and runs a catch-up step before the k - 1
  decode steps, and under CUDA MPS the call shares the GPU with the other batch's Verify. On the
  H200 (bench/results/HISTORY.md, session 22) 32 rows took 20.6 ms at k = 1 and about 30 ms at k = 4; the
  former model ``k * (c_d + d_d * n)`` predicted 82 ms for k = 4, so adaptive k settled at k = 1
  (1896 tok/s at c = 64 against 2117 at a fixed k = 4).
- verifying n requests with k draft tokens each: one fit per k, ``t_verify(n, k) = a_k + b_k * n``.
  Rows and draft positions are kept apart because they cost
  differently: on the 2-core CPU of BENCHMARKS.md a verify of 4 rows cost 180 ms at k = 1 and
  175 ms at k = 4 (flat in k) but 92 ms for 1 row (steep in n); one fit over ``n * (k + 1)``
  positions mixed the two and predicted a steep growth in k, so adaptive k chose k = 1.

Each per-k fit is aged by every call (of any k) since its last observation, so a k measured
again after a load change is not outvoted by its stale past (``FitsByK``). A k not measured yet
is predicted from the measured ones: linearly between two, linearly (slope >= 0) beyond the two
nearest on one side (below them never under the share of the work, ``t(k0) * w(k) / w(k0)``
with w the positions ``k + 1`` of a verify, the forwards ``k`` of a draft); when only one k
was measured, flat for a verify (the optimistic guess; ``coordinator.adaptive`` explores
neighbouring k to correct it) and proportional to k for a draft (k forwards: the native
drafter's call, and a guess that makes smaller k look cheap, so they get measured too).
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


class FitsByK:
    """One ``LinearFit`` over rows n per k (module docstring: aging, unmeasured k).

    Args:
        decay: the fits' decay per observation.
        work: the share of work of k (verify: positions ``k + 1``; draft: forwards ``k``).
        is_one_k_proportional: with one k measured, predict other k in proportion to ``work``
            (else flat).
    """

    def __init__(self, decay: float, work, is_one_k_proportional: bool) -> None:
        self.decay, self._work, self._is_one_k_proportional = decay, work, is_one_k_proportional
        self.fits: dict[int, LinearFit] = {}
        self.num_calls = 0
        self._last_call: dict[int, int] = {}  # k -> num_calls at its last observation

    def __contains__(self, k: int) -> bool:
        return k in self.fits

    def __bool__(self) -> bool:
        return bool(self.fits)

    def observe(self, num_requests: int, k: int, ms: float) -> None:
        self.num_calls += 1
        age = self.num_calls - self._last_call.get(k, self.num_calls - 1)
        self._last_call[k] = self.num_calls
        self.fits.setdefault(k, LinearFit(self.decay)).observe(num_requests, ms, age)

    def predict(self, num_requests: int, k: int) -> float:
        """Predicted ms at n rows and k (0 before any observation)."""
        if not self.fits:
            return 0.0
        if k in self.fits:
            return self._at(k, num_requests)
        seen = sorted(self.fits)
        lower, upper = [s for s in seen if s < k], [s for s in seen if s > k]
        if lower and upper:
            return self._line(lower[-1], upper[0], num_requests, k)
        if len(lower) >= 2:
            return self._line(lower[-2], lower[-1], num_requests, k)
        if len(upper) >= 2:
            return max(self._line(upper[0], upper[1], num_requests, k), self._share(upper[0], num_requests, k))
        only = (lower or upper)[0]
        return self._share(only, num_requests, k) if self._is_one_k_proportional else self._at(only, num_requests)

    def _share(self, k0: int, num_requests: int, k: int) -> float:
        """The prediction at measured k0 scaled by the work of k (affine in work, a >= 0: a floor below k0)."""
        return self._at(k0, num_requests) * self._work(k) / self._work(k0)

    def _at(self, k: int, num_requests: int) -> float:
        """The k fit at n rows; a fit that saw one n only takes the row slope of the most
        observed fit that has one (rows cost about the same whatever k), else stays flat."""
        fit = self.fits[k]
        sloped = [other for other in self.fits.values() if other.has_slope]
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


class StepCostModel:
    """``t_draft(n, k)`` and ``t_verify(n, k)`` (ms) from measured engine times (module docstring)."""

    def __init__(self, decay: float = DEFAULT_DECAY) -> None:
        self.decay = decay
        self.draft_by_k = FitsByK(decay, work=lambda k: k, is_one_k_proportional=True)  # ms per Draft call
        self.verify_by_k = FitsByK(decay, work=lambda k: k + 1, is_one_k_proportional=False)  # ms per Verify call
        self._overhead = LinearFit(decay)  # its decayed mean: ms of a step beyond its critical compute

    @property
    def num_draft_calls(self) -> int:
        """Draft calls observed (paces exploration in ``coordinator.adaptive``)."""
        return self.draft_by_k.num_calls

    @property
    def num_verify_calls(self) -> int:
        return self.verify_by_k.num_calls

    @property
    def is_known(self) -> bool:
        """Both engines have been timed at least once."""
        return bool(self.draft_by_k) and bool(self.verify_by_k)

    def is_measured(self, k: int) -> bool:
        """Whether both a Draft and a Verify call at this k were timed."""
        return k in self.draft_by_k and k in self.verify_by_k

    def observe_draft(self, num_requests: int, k: int, draft_ms: float) -> None:
        """One Draft call of ``k`` tokens (its widest row) for ``num_requests`` rows that took ``draft_ms``."""
        if num_requests > 0 and k > 0:
            self.draft_by_k.observe(num_requests, k, draft_ms)

    def observe_verify(self, num_requests: int, k: int, verify_ms: float) -> None:
        """One Verify call of ``num_requests`` rows with ``k`` draft tokens each (0: decode)."""
        if num_requests > 0 and k >= 0:
            self.verify_by_k.observe(num_requests, k, verify_ms)

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
        """Predicted ms of one Draft call (module docstring: measured k, else from neighbours)."""
        return self.draft_by_k.predict(num_requests, k) if num_requests and k else 0.0

    def verify_ms(self, num_requests: int, k: int) -> float:
        """Predicted ms of one Verify call (module docstring: measured k, else from neighbours)."""
        return self.verify_by_k.predict(num_requests, k) if num_requests else 0.0
