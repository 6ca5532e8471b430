"""Adaptive number of draft tokens k (``--k-policy adaptive``; torch-free).

Source: MineDraft paper (Tang, Verma et al. 2026), §4, Lemma 2: a PSD step takes
``max(t_draft, t_verify)``, so its time per committed token is lowest when drafting and
verification take equally long; the paper fixes k and leaves adapting it as future work (§7).

Per batch (PSD batch 0 or 1, or the one ``sd`` batch of n requests) the next k maximises
expected committed tokens per unit of step time (``coordinator.cost_model``)::

    k* = argmax_{1 <= k <= k_max}  n * E(alpha, k) / T(n, k)   (the smallest k within 1% of the max)
    T = max(t_draft(n, k), t_verify(n, k)) + t_fixed   in psd (drafting overlaps the other batch's verify)
    T = t_draft(n, k) + t_verify(n, k) + t_fixed        in sd

t_fixed is the step's measured time beyond the engines' critical compute (RPCs, the
coordinator's own work; ``StepCostModel.overhead_ms``). No k changes it, but it dilutes what a
shorter draft saves: on the GPU of BENCHMARKS.md it was 3-4 ms of a 13 ms psd step, and without
it the choice drifted to k = 2-3 on verify-time noise while k = 4 committed more tokens per step.

With t_verify flat in k (memory-bound verifier) the psd optimum sits where t_draft(k) reaches
t_verify (Lemma 2); in sd it is the classic trade-off of Leviathan et al. 2023, §3.4. t_draft and
t_verify are fitted per k (``coordinator.cost_model``: a Draft call has a fixed part besides its
k forwards); a k never measured is predicted from its neighbours, so every
``explore_every_steps``-th Draft call drafts a neighbour of the best k (an unmeasured one first)
to measure how draft and verify time really grow in k.

Per request (ragged rows: the engines take a per-row k_i in one Draft and one Verify call,
``DraftSeq.num_draft_tokens`` / ``VerifyRequest.num_draft_tokens``): request i of a batch at k
gets its own ``k_i`` in [1, k], the k maximising its expected committed tokens per unit of the
step cost it adds, from its own acceptance estimate alpha_i::

    k_i = argmax_{1 <= j <= k}  E(alpha_i, j) / (T(n, k) / n + m(j))   (the smallest j within 1%)
    m(j) = T(t_draft(n - 1, k) + dd(j), t_verify(n - 1, k) + dv(j)) - T(t_draft(n - 1, k), t_verify(n - 1, k))
    dd(j) = t_draft(n, j) - t_draft(n - 1, j),   dv(j) = t_verify(n, j) - t_verify(n - 1, j)

(its share of the step plus what drafting and verifying j tokens for one more row adds to the
step: in psd only the binding side counts, so hidden draft positions are free), so a request
whose drafts keep being rejected (E flat in j) drafts 1 token while a well-accepted one drafts k. Before the costs are measured every request gets k.

A request whose acceptance is even below ``min_request_alpha`` may be left undrafted (k = 0),
except every ``probe_every_steps`` verify steps, when it is drafted again (at its k_i) to
refresh its estimate. An undrafted request needs a Verify call of its own (with the requests
that have no room for drafts), so :meth:`KChooser.draft_ks` leaves requests undrafted only when
the expected goodput of the two calls beats one call with every request at its k_i (on a CPU,
where a Verify call's fixed cost is large, it rarely does).

Lossless: the rejection sampler is exact for any k and any draft (Leviathan et al. 2023,
Theorem 1), row by row, so changing k between steps or per request (k_i, ragged rows) never
changes the output distribution.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.cost_model import AcceptanceEstimate, StepCostModel, critical_ms, expected_tokens

NO_DRAFT = 0  # a request verified without draft tokens this step
K_TIE_TOLERANCE = 0.01  # the smallest k within this fraction of the best goodput is taken


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
        explore_every_steps: every this many Draft calls one drafts a neighbour of the best k (>= 2).
    """

    decay: float = 0.9
    min_request_alpha: float = 0.1
    probe_every_steps: int = 8
    prior_alpha: float = 0.6
    explore_every_steps: int = 8

    def __post_init__(self) -> None:
        checks = {"decay": 0.0 < self.decay < 1.0, "min_request_alpha": 0.0 <= self.min_request_alpha < 1.0,
                  "probe_every_steps": self.probe_every_steps >= 1, "prior_alpha": 0.0 < self.prior_alpha < 1.0,
                  "explore_every_steps": self.explore_every_steps >= 2}
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
        self.observe_call([(request_id, k, num_accepted)])

    def observe_call(self, verified: list[tuple[str, int, int]]) -> None:
        """The ``(request_id, k, num_accepted)`` of every request of one Verify call (k = 0: not
        drafted). Each request's estimate ages per its own draft; the batch estimate per call."""
        for request_id, k, num_accepted in verified:
            record = self._record(request_id)
            if k == NO_DRAFT:
                record.num_steps_undrafted += 1
                continue
            record.num_steps_undrafted = 0
            record.acceptance.observe(k, num_accepted)
        self.acceptance.observe_call([(k, num_accepted) for _, k, num_accepted in verified])

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
        """k for the next draft of a batch of ``num_requests`` (``is_parallel``: psd overlap):
        the goodput-best k, or on exploration Draft calls a neighbour of it."""
        if not self.is_adaptive or not self.stats.cost.is_known or num_requests <= 0:
            return self.max_k
        goodputs = {k: self.goodput(num_requests, k, is_parallel) for k in range(1, self.max_k + 1)}
        top = max(goodputs.values())
        best = min(k for k, value in goodputs.items() if value >= top * (1.0 - K_TIE_TOLERANCE))
        return self._explored(best)

    def _explored(self, best: int) -> int:
        """``best``, or on every ``explore_every_steps``-th Draft call a neighbour (unmeasured first)."""
        num_calls, every = self.stats.cost.num_draft_calls, self.stats.cfg.explore_every_steps
        neighbours = [k for k in (best - 1, best + 1) if 1 <= k <= self.max_k]
        if not neighbours or (num_calls + 1) % every:
            return best
        unmeasured = [k for k in neighbours if not self.stats.cost.is_measured(k)]
        return (unmeasured or neighbours)[(num_calls // every) % len(unmeasured or neighbours)]

    def goodput(self, num_requests: int, k: int, is_parallel: bool) -> float:
        """Expected committed tokens per ms of a step with ``num_requests`` at ``k`` (0 = ar)."""
        cost = self.stats.cost
        step_ms = self._step_ms(cost.draft_ms(num_requests, k), cost.verify_ms(num_requests, k), is_parallel)
        tokens = num_requests * expected_tokens(self.stats.acceptance.alpha, k)
        return tokens / step_ms if step_ms > 0 else 0.0

    def request_k(self, request_id: str, batch_k: int) -> int:
        """``batch_k``, or :data:`NO_DRAFT` for a request whose drafts keep being rejected."""
        if not self.is_adaptive or batch_k == NO_DRAFT:
            return batch_k
        if self.stats.request_alpha(request_id) >= self.stats.cfg.min_request_alpha:
            return batch_k
        return batch_k if self.stats.is_probe_due(request_id) else NO_DRAFT

    def is_probe(self, request_id: str) -> bool:
        """Whether the request is drafted only to refresh its low acceptance estimate (a probe)."""
        return (self.is_adaptive and self.stats.request_alpha(request_id) < self.stats.cfg.min_request_alpha
                and self.stats.is_probe_due(request_id))

    def _row_costs(self, batch_k: int, num_requests: int, is_parallel: bool) -> list[float] | None:
        """ms one row of the batch costs at k_i = 1..``batch_k``: its share of the step plus what
        drafting and verifying k_i tokens for it adds (module docstring); the same for every
        request of the batch, so computed once per Draft call. None: every row gets ``batch_k``."""
        cost = self.stats.cost
        if not self.is_adaptive or not cost.is_known or batch_k <= 1 or num_requests <= 0:
            return None
        n = num_requests
        share = self._step_ms(cost.draft_ms(n, batch_k), cost.verify_ms(n, batch_k), is_parallel) / n
        others_draft, others_verify = cost.draft_ms(n - 1, batch_k), cost.verify_ms(n - 1, batch_k)
        others_ms = self._step_ms(others_draft, others_verify, is_parallel)
        costs = []
        for k in range(1, batch_k + 1):  # psd: only the binding side counts
            row_draft = cost.draft_ms(n, k) - cost.draft_ms(n - 1, k)
            row_verify = cost.verify_ms(n, k) - cost.verify_ms(n - 1, k)
            step_ms = self._step_ms(others_draft + row_draft, others_verify + row_verify, is_parallel)
            costs.append(share + max(step_ms - others_ms, 0.0))
        return costs

    def _step_ms(self, t_draft: float, t_verify: float, is_parallel: bool) -> float:
        """A step's ms: the engines' critical compute plus the measured fixed per-step overhead
        (RPCs, the coordinator's own work; ``StepCostModel.overhead_ms``), which no k changes."""
        return critical_ms(t_draft, t_verify, is_parallel) + self.stats.cost.overhead_ms

    def draft_ks(self, request_ids: list[str], is_parallel: bool) -> dict[str, int]:
        """k_i of each request of one batch's next Draft call: its own k_i under the batch's k
        (ragged rows; ``_best_own_k`` over the batch's ``_row_costs``), or :data:`NO_DRAFT` for
        the low-acceptance requests of :meth:`request_k` when verifying them in a call of their
        own (k = 0) is expected to pay (module docstring). Deterministic between Draft calls."""
        k = self.batch_k(len(request_ids), is_parallel)
        costs = self._row_costs(k, len(request_ids), is_parallel)
        ks = {rid: k if costs is None else _best_own_k(self.stats.request_alpha(rid), costs) for rid in request_ids}
        low = {rid for rid in request_ids if self.request_k(rid, k) == NO_DRAFT}
        if not low or not self._is_split_better(ks, low, is_parallel):
            return ks
        return {rid: NO_DRAFT if rid in low else k_i for rid, k_i in ks.items()}

    def _is_split_better(self, ks: dict[str, int], low: set[str], is_parallel: bool) -> bool:
        """Goodput of drafting all at their k_i (one Verify call) vs leaving ``low`` undrafted (two)."""
        cost, stats = self.stats.cost, self.stats
        tokens = {rid: expected_tokens(stats.request_alpha(rid), k_i) for rid, k_i in ks.items()}
        k_all = max(ks.values())
        k_high = max((k_i for rid, k_i in ks.items() if rid not in low), default=k_all)
        n, n_high = len(ks), len(ks) - len(low)
        one_call = sum(tokens.values()) / max(self._step_ms(cost.draft_ms(n, k_all), cost.verify_ms(n, k_all),
                                                            is_parallel), 1e-9)
        split_ms = self._step_ms(cost.draft_ms(n_high, k_high),
                                 cost.verify_ms(n_high, k_high) + cost.verify_ms(len(low), 0), is_parallel)
        split_tokens = sum(t for rid, t in tokens.items() if rid not in low) + len(low)
        return split_tokens / max(split_ms, 1e-9) > one_call


def _best_own_k(alpha: float, costs: list[float]) -> int:
    """The k_i (1-based index into ``costs``, ms per row at k_i) with the most expected tokens
    per ms at acceptance ``alpha``; the smallest within ``K_TIE_TOLERANCE`` of the best."""
    rates = [expected_tokens(alpha, k) / max(ms, 1e-9) for k, ms in enumerate(costs, start=1)]
    top = max(rates)
    return 1 + next(i for i, rate in enumerate(rates) if rate >= top * (1.0 - K_TIE_TOLERANCE))
