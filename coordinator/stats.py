"""Per-step records and running totals of the coordinator's step loop (torch-free)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

MAX_RECENT_STEPS = 1024


@dataclass(frozen=True)
class StepStats:
    """What one coordinator step did.

    Attributes:
        mode: "ar", "sd" or "psd" as actually run (``ar`` while the drafter is unavailable).
        step_id: coordinator step id (monotonic from 1).
        num_verify: requests verified (or decoded) this step.
        num_draft: requests drafted this step (both the batch verified now and the skip batch).
        k: draft tokens per request in the verify (0 = plain decode).
        num_draft_tokens: draft tokens verified this step (k per request still running).
        num_accepted_tokens: of those, accepted by the rejection sampler and emitted (tokens cut by
            stop, EOS or max_tokens do not count; vLLM counts the same way).
        num_emitted_tokens: tokens streamed to clients this step (after finish truncation).
        draft_ms: drafter compute time reported by drafter_svc, summed over Draft calls (ms).
        verify_ms: verifier compute time reported by verifier_svc (ms).
        data_plane_ms: draft-probs transfer time reported by the engines (ms).
        idle_ms: time the verifier was idle within the step = step wall time - verify_ms (ms);
            in ``psd`` with t_draft <= t_verify it is only RPC overhead (paper §4).
        wall_ms: wall-clock time of the step (ms).
        is_parallel: both batches were busy (one drafted while the other was verified).
    """

    mode: str
    step_id: int
    num_verify: int
    num_draft: int
    k: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    draft_ms: float
    verify_ms: float
    data_plane_ms: float
    idle_ms: float
    wall_ms: float
    is_parallel: bool


@dataclass
class StepTimes:
    """Engine-reported times (ms) and the number of drafted requests, summed while a step runs;
    ``phases``: one ``coordinator.tracing.Phase`` per engine call (for the step log / timeline)."""

    draft_ms: float = 0.0
    verify_ms: float = 0.0
    data_plane_ms: float = 0.0
    num_drafted: int = 0
    phases: list = field(default_factory=list)


class StepTotals:
    """Running totals over all steps plus a bounded window of the recent ``StepStats``."""

    def __init__(self, max_recent: int = MAX_RECENT_STEPS) -> None:
        self.num_steps = 0
        self.num_parallel_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0
        self.draft_ms = 0.0
        self.verify_ms = 0.0
        self.data_plane_ms = 0.0
        self.idle_ms = 0.0
        self.wall_ms = 0.0
        self.recent: collections.deque[StepStats] = collections.deque(maxlen=max_recent)

    def record(self, stats: StepStats) -> None:
        self.num_steps += 1
        self.num_parallel_steps += int(stats.is_parallel)
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        self.num_emitted_tokens += stats.num_emitted_tokens
        self.draft_ms += stats.draft_ms
        self.verify_ms += stats.verify_ms
        self.data_plane_ms += stats.data_plane_ms
        self.idle_ms += stats.idle_ms
        self.wall_ms += stats.wall_ms
        self.recent.append(stats)

    def retract(self, num_draft_tokens: int, num_accepted_tokens: int, num_emitted_tokens: int) -> None:
        """Take back tokens recorded by steps that the gateway then cut off at a stop string
        (``coordinator.emitted``); the recent ``StepStats`` keep what each step streamed."""
        self.num_draft_tokens -= num_draft_tokens
        self.num_accepted_tokens -= num_accepted_tokens
        self.num_emitted_tokens -= num_emitted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over all steps (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def parallel_step_ratio(self) -> float:
        """Share of steps where both batches were busy (0.0 before any step)."""
        return self.num_parallel_steps / self.num_steps if self.num_steps else 0.0

