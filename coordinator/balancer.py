"""Feedback batch balancer for PSD (``--balancer feedback``; torch-free).

The MineDraft paper (§5.1) balances the two batches only before the first step (``assign()``);
after it every new request joins ``skip_batch``, so an imbalance left by finishes, aborts or
preemption stays. This balancer keeps balancing, by expected step cost rather than request count:

    cost(request) = (k + 1) + kv_weight * kv_tokens

i.e. the positions its verify scores plus the attention work over the KV it holds (``kv_tokens``
= its committed length), in units of one scored position; a batch's cost is the sum.

Rules (every new request is still drafted before its first verify):

- Before the first step each new request goes to the cheaper batch (ties: ``skip_batch``).
- After it a new request may only join the batch drafted this step (the *effective* skip batch:
  ``skip_batch``, or the other one when the batch to verify is empty and the step loop flips).
  It is admitted now while that batch is the cheaper one; otherwise it waits in the queue for
  the next step, when the roles swap (:meth:`Balancer.num_to_admit`); a request held once is
  admitted at the next step, so the balancer delays a request by at most one step.
- When the batch about to be verified is heavier than the other by more than
  ``migrate_ratio`` of their total, one of its requests moves to the batch drafted this step
  (:meth:`Balancer.pick_migration`): its pending drafts are dropped, it is drafted again now and
  verified next step (one step later; the output distribution is unchanged).

``paper`` keeps the paper's rule (no gating, no migration).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.batch_manager import BatchManager

CostFn = Callable[[str], float]  # request id -> cost (scored positions + weighted KV tokens)


class BalancerPolicy(enum.StrEnum):
    PAPER = "paper"
    FEEDBACK = "feedback"


@dataclass(frozen=True)
class BalancerConfig:
    """Attributes:
        policy: ``paper`` or ``feedback``.
        kv_weight: cost of one KV token relative to one scored position (>= 0).
        migrate_ratio: cost imbalance (share of both batches' total, in (0, 1]) above which one
            request migrates per step.
    """

    policy: BalancerPolicy | str = BalancerPolicy.PAPER
    kv_weight: float = 1.0 / 256
    migrate_ratio: float = 0.25

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", BalancerPolicy(self.policy))
        except ValueError:
            raise ValueError(f"policy: must be paper or feedback, got {self.policy!r}") from None
        if self.kv_weight < 0:
            raise ValueError(f"kv_weight: must be >= 0, got {self.kv_weight}")
        if not 0.0 < self.migrate_ratio <= 1.0:
            raise ValueError(f"migrate_ratio: must be in (0, 1], got {self.migrate_ratio}")


class Balancer:
    """Placement, admission gating and migration over a :class:`BatchManager` (module docstring)."""

    def __init__(self, cfg: BalancerConfig = BalancerConfig()) -> None:
        self.cfg = cfg

    @property
    def is_feedback(self) -> bool:
        return self.cfg.policy == BalancerPolicy.FEEDBACK

    def request_cost(self, num_positions: int, num_kv_tokens: int) -> float:
        return num_positions + self.cfg.kv_weight * num_kv_tokens

    @staticmethod
    def effective_skip(batches: BatchManager) -> int:
        """The batch drafted at the next step (the step loop flips when the other one is empty)."""
        skip = batches.skip_batch
        return 1 - skip if batches.is_started and batches.is_empty(1 - skip) else skip

    @staticmethod
    def batch_cost(batches: BatchManager, index: int, cost_of: CostFn) -> float:
        return sum(cost_of(r) for r in batches.batch(index))

    def assign(self, batches: BatchManager, request_ids: Sequence[str], cost_of: CostFn,
               max_num_seqs: int) -> list[int]:
        """Place admitted requests (the caller admits at most what fits: 2m running, and after the
        first step the drafted batch's room); returns their batch indices."""
        if not self.is_feedback:
            return batches.assign(request_ids)
        if batches.is_started:
            if request_ids and batches.is_empty(1 - batches.skip_batch):
                batches.flip()  # what the step loop would do first: newcomers join the batch drafted now
            return [batches.place(r, batches.skip_batch) for r in request_ids]
        costs = [self.batch_cost(batches, i, cost_of) for i in (0, 1)]
        indices = []
        for request_id in request_ids:
            skip = batches.skip_batch
            index = skip if costs[skip] <= costs[1 - skip] else 1 - skip
            if len(batches.batch(index)) >= max_num_seqs:  # full: m per batch
                index = 1 - index
            indices.append(batches.place(request_id, index))
            costs[index] += cost_of(request_id)
        return indices

    def num_to_admit(self, batches: BatchManager, new_costs: Sequence[float], max_num_seqs: int,
                     cost_of: CostFn, was_held: bool = False) -> int:
        """How many of the queue's head (``new_costs``, FIFO) join now; the rest wait a step.
        ``was_held``: the head already waited a step (then at least one joins: bounded wait)."""
        if not self.is_feedback or not batches.is_started:
            return len(new_costs)
        skip = self.effective_skip(batches)
        if len(batches.batch(1 - skip)) >= max_num_seqs:
            return len(new_costs)  # the other batch cannot take them next step
        skip_cost, other_cost = (self.batch_cost(batches, i, cost_of) for i in (skip, 1 - skip))
        num = 1 if was_held and new_costs else 0
        skip_cost += sum(new_costs[:num])
        while num < len(new_costs) and skip_cost < other_cost:
            skip_cost += new_costs[num]
            num += 1
        return num

    def pick_migration(self, batches: BatchManager, max_num_seqs: int, cost_of: CostFn) -> str | None:
        """A request of the batch about to be verified to move to the one drafted now, or None."""
        if not self.is_feedback or not batches.is_started:
            return None
        skip = self.effective_skip(batches)
        verify_ids = batches.batch(1 - skip)
        if len(batches.batch(skip)) >= max_num_seqs or len(verify_ids) < 2:
            return None
        verify_cost, skip_cost = self.batch_cost(batches, 1 - skip, cost_of), self.batch_cost(batches, skip, cost_of)
        diff = verify_cost - skip_cost
        if diff <= self.cfg.migrate_ratio * (verify_cost + skip_cost):
            return None
        movable = [r for r in verify_ids if 0 < cost_of(r) < diff]  # moving r: |diff - 2 c(r)| < diff
        return min(reversed(movable), key=lambda r: abs(diff - 2 * cost_of(r)), default=None)
