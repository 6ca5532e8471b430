"""The fan-out of ``drafter_svc.processes.DraftProcesses``: its draft answers merged in request
order, and how even its calls' rows fall over the processes."""

from __future__ import annotations

import logging

logger = logging.getLogger("drafter_svc.processes")


class FanOutStats:
    """How even the draft calls' rows fall over the processes, and what the fan-out adds: every
    ``log_every`` calls, logged at INFO (and kept in ``last``)::

        draft processes (last 200 calls): 32.0 rows a call, 17.1 in the busiest of 2 (16.0 if even);
        call 24.1 ms = slowest process 23.6 + fan-out and merge 0.5
    """

    def __init__(self, num_processes: int, log_every: int = 200) -> None:
        self.num_processes, self.log_every = num_processes, log_every
        self._sums, self._calls = [0.0] * 4, 0
        self.last: dict[str, float] = {}

    def add(self, rows: int, busiest_rows: int, call_ms: float, slowest_ms: float) -> None:
        for i, value in enumerate((rows, busiest_rows, call_ms, slowest_ms)):
            self._sums[i] += value
        self._calls += 1
        if self._calls >= self.log_every:
            rows, busiest, call, slowest = (s / self._calls for s in self._sums)
            self.last = {"calls": self._calls, "rows": rows, "busiest_rows": busiest, "call_ms": call,
                         "slowest_process_ms": slowest}
            logger.info("draft processes (last %d calls): %.1f rows a call, %.1f in the busiest of %d (%.1f if even); "
                        "call %.1f ms = slowest process %.1f + fan-out and merge %.1f", self._calls, rows, busiest,
                        self.num_processes, rows / self.num_processes, call, slowest, call - slowest)
            self._sums, self._calls = [0.0] * 4, 0


def merge_drafts(num_rows: int, k: int, rows_of: dict[int, list[int]], results: dict[int, tuple]):
    """The processes' (ids, probs) answers in request order. Probs [b, k, V] when any process
    returned some (zeros past a row's k_i, as one engine's); the rows of a process that returned
    none (all its rows greedy) get the one-hot of their draft tokens, which is what one engine
    gives greedy rows beside sampled ones and what a verifier assumes of absent probs. None when
    no process returned probs."""
    token_ids: list[list[int]] = [[] for _ in range(num_rows)]
    for i, rows in rows_of.items():
        for row, ids in zip(rows, results[i][0]):
            token_ids[row] = ids
    parts = {i: results[i][1] for i in rows_of if results[i][1] is not None}
    if not parts:
        return token_ids, None
    import torch

    sample = next(iter(parts.values()))
    probs = torch.zeros((num_rows, k, sample.shape[-1]), dtype=sample.dtype)
    for i, rows in rows_of.items():
        if i in parts:
            probs[rows, :parts[i].shape[1]] = parts[i]
            continue
        for row in rows:
            probs[row, torch.arange(len(token_ids[row])), token_ids[row]] = 1.0
    return token_ids, probs
