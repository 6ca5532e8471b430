"""``DraftCallStats``: where the vLLM drafter's draft calls spend their time, inside the service.

A draft call of ``VllmDraftWorker`` (or ``VllmSessionDraftWorker``) has three parts: the
admission of its rows (one ``LLMEngine.add_request`` per row, or one session resume per row),
the first engine step (each row's catch-up on the tokens the verifier committed, plus its first
draft token) and the later steps (one draft token each). ``bench.engines.draft_calls`` measures
them for a call alone; this records them for the calls the service serves, so that a run of the
whole stack says which part grows there (session 22: a 32-row call took 30 ms in the stack
against 20 ms alone). Torch-free.

Every ``log_every`` calls, or after ``log_every_s`` seconds with at least ``MIN_CALLS_LOGGED``
calls, the medians of each row-count bucket (rows up to 1, 2, 4, ..., 64, more) are logged at
INFO on ``specdec.vllm_backend.call_stats`` and kept in ``last_summary``::

    draft calls (last 200): rows<=32: 180 calls, rows 32, ms total 29.8 = admit 3.1 + first step 8.2 + later 3 x 3.9, other 6.9
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_LOG_EVERY = 200
DEFAULT_LOG_EVERY_S = 10.0
MIN_CALLS_LOGGED = 10


@dataclass(frozen=True)
class CallSplit:
    """One draft call (ms; ``later_ms``: each step after the first)."""

    rows: int
    total_ms: float
    admit_ms: float
    first_step_ms: float
    later_ms: tuple[float, ...]


class DraftCallStats:
    """Timestamps of one draft call at a time: ``start(rows)``, ``admitting()``, ``admitted()``,
    ``stepped()`` after each engine step, ``end()``; medians logged every ``log_every`` calls (0: off, nothing
    kept) or every ``log_every_s`` seconds (monotonic) once ``MIN_CALLS_LOGGED`` calls are filed.

    Raises:
        ValueError: ``log_every`` < 0 or ``log_every_s`` <= 0.
    """

    def __init__(self, log_every: int = DEFAULT_LOG_EVERY, log_every_s: float = DEFAULT_LOG_EVERY_S) -> None:
        if log_every < 0:
            raise ValueError(f"log_every: must be >= 0, got {log_every}")
        if log_every_s <= 0:
            raise ValueError(f"log_every_s: must be > 0, got {log_every_s}")
        self.log_every, self.log_every_s = log_every, log_every_s
        self._window_start = time.monotonic()
        self.calls: list[CallSplit] = []        # since the last log
        self.last_summary: dict[str, dict[str, float]] = {}
        self._start = self._admitting = self._admitted = 0.0
        self._steps: list[float] = []
        self._rows = 0

    def start(self, rows: int) -> None:
        """A draft call of ``rows`` rows begins (its bookkeeping before the engine counts as other)."""
        self._rows, self._steps = rows, []
        self._start = self._admitting = self._admitted = time.perf_counter()

    def admitting(self) -> None:
        """The call's rows start going to the engine (vLLM requests added or sessions resumed)."""
        self._admitting = self._admitted = time.perf_counter()

    def admitted(self) -> None:
        self._admitted = time.perf_counter()

    def stepped(self) -> None:
        self._steps.append(time.perf_counter())

    def end(self) -> None:
        """File the call begun by the last ``start`` (``log_every`` 0: nothing is kept); log when
        ``log_every`` calls are filed."""
        if not self.log_every:
            return
        end = time.perf_counter()
        marks = [self._admitted] + self._steps
        steps = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        self.calls.append(CallSplit(self._rows, (end - self._start) * 1e3, (self._admitted - self._admitting) * 1e3,
                                    steps[0] if steps else 0.0, tuple(steps[1:])))
        is_due = time.monotonic() - self._window_start >= self.log_every_s and len(self.calls) >= MIN_CALLS_LOGGED
        if len(self.calls) >= self.log_every or is_due:
            self._window_start = time.monotonic()
            self.last_summary = summarize(self.calls)
            for bucket, med in self.last_summary.items():
                logger.info("draft calls (last %d): %s: %d calls, rows %.0f, ms total %.1f = admit %.1f + first step "
                            "%.1f + later %.1f x %.1f, other %.1f", len(self.calls), bucket, med["calls"], med["rows"],
                            med["total_ms"], med["admit_ms"], med["first_step_ms"], med["later_steps"],
                            med["later_step_ms"], med["other_ms"])
            self.calls = []


def row_bucket(rows: int) -> str:
    """``rows<=N`` for the smallest power of two N >= rows (up to 64), else ``rows>64``."""
    bound = 1
    while bound < rows and bound < 64:
        bound *= 2
    return f"rows<={bound}" if rows <= bound else "rows>64"


def summarize(calls: list[CallSplit]) -> dict[str, dict[str, float]]:
    """Per row bucket: the number of calls and the medians of rows, total, admission, first-step
    and later-step ms (``later_step_ms``: median of all later steps), later steps per call, and
    ``other_ms`` = total - admission - all steps (the worker's own bookkeeping: checks, the
    committed sequences, the rows' results)."""
    buckets: dict[str, list[CallSplit]] = {}
    for call in calls:
        buckets.setdefault(row_bucket(call.rows), []).append(call)
    out = {}
    for bucket, group in sorted(buckets.items(), key=lambda item: min(c.rows for c in item[1])):
        later = [ms for c in group for ms in c.later_ms]
        out[bucket] = {
            "calls": len(group),
            "rows": statistics.median(c.rows for c in group),
            "total_ms": statistics.median(c.total_ms for c in group),
            "admit_ms": statistics.median(c.admit_ms for c in group),
            "first_step_ms": statistics.median(c.first_step_ms for c in group),
            "later_steps": statistics.median(len(c.later_ms) for c in group),
            "later_step_ms": statistics.median(later) if later else 0.0,
            "other_ms": statistics.median(c.total_ms - c.admit_ms - c.first_step_ms - sum(c.later_ms) for c in group),
        }
    return out
