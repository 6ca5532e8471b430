"""``DraftProcesses``: one drafter's draft engine split over P processes, each request homed on one.

Why: a vLLM draft call is k engine steps whose host work (vLLM's scheduler, input preparation,
output processing: 3-5 ms a step around ~1 ms of a 0.6B model's GPU work on an H100) runs in one
Python thread, so at c = 64 psd's step waits on the drafter (BENCHMARKS.md, session 30: a 32-row
call 31.3 ms against a 17.0-ms verify). P engine processes on the same GPU (under CUDA MPS, as the
stack's engines share it) run those steps side by side on P host cores, each on its own rows;
``bench.engines.parallel_drafters`` measures the call alone. Set by ``--draft-processes P``.

The contract is ``specdec.engine_api.DraftEngine``'s, so the drafter service and the coordinator
do not change. Each process builds the same engine with ``M / P`` of the ``M`` slots (and
1/P of the GPU memory share or CPU KV space); the engines start one after another, since vLLM
sizes its KV cache from the memory it finds free. A request is homed on one process when it is
added, for its life: newcomers go where the batch they will join next has the fewest rows (in
psd the coordinator drafts the two batches in turn and adds newcomers to the batch drafted next,
so that batch is the one drafted two calls back), ties to the process with fewest requests. A
draft call sends each process its rows at once and merges the answers in request order; it
takes as long as the slowest process. Every check that can refuse a call runs here first, so a
refused call changes no state in any process (as one engine's). A process that dies (noticed at
once by a watcher thread) or leaves a call unanswered for ``call_timeout_s`` (stuck) is lost:
every later call raises ``DraftProcessError``, and ``on_lost`` is called once:
the drafter service then drains and exits non-zero, so that ``minedraft up`` or the container's
restart policy starts it afresh while the coordinator runs ``ar`` (as when the drafter is killed).
A draft process exits by itself as soon as the drafter is gone (``process_main``), so no engine
outlives it holding GPU memory.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

from drafter_svc.fan_out import FanOutStats, merge_drafts
from drafter_svc.process_main import serve_engine
from specdec.engine_api import EngineFacts
from specdec.vllm_backend.bookkeeping import check_new_ids, check_token_ids, known_states

logger = logging.getLogger("drafter_svc.processes")
START_TIMEOUT_S = 1800.0   # one process's engine build (a vLLM engine on a fresh GPU host: minutes)
CALL_TIMEOUT_S = 60.0      # one call's answer (draft calls take milliseconds on a GPU, well under 1 s on CPU)


class DraftProcessError(RuntimeError):
    """A draft process died or never started; the drafter cannot draft until it is restarted."""


class DraftProcesses:
    """A ``DraftEngine`` over ``num_processes`` processes (module docstring).

    Args:
        builds: one picklable zero-argument callable per process, each returning that process's
            engine (``drafter_svc.worker.process_builds``); the engines must agree on vocabulary
            and ``max_model_len``.
        log_level: the processes' logging level.
        start_timeout_s: seconds one process may take to build its engine.
        call_timeout_s: seconds a process may take to answer a call before it counts as lost.
        on_lost: called once (from the watcher thread or the calling one) when a process is lost.

    Raises:
        DraftProcessError: a process failed to start (the others are stopped); the error it
            raised is the cause.
    """

    def __init__(self, builds: list[Callable[[], object]], log_level: str = "INFO",
                 start_timeout_s: float = START_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S,
                 on_lost: Callable[[], None] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")   # CUDA and vLLM in the parent rule out fork
        self._conns, self._procs, facts = [], [], []
        self._broken: str | None = None
        self._is_closing = False
        self._on_lost, self._lost_lock = None, threading.Lock()   # a failed start raises instead
        self.call_timeout_s = call_timeout_s
        try:
            for i, build in enumerate(builds):   # one at a time: each engine sizes its KV from free memory
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=serve_engine, args=(build, child, log_level, os.getpid()),
                                   name=f"draft-process-{i}")
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
                facts.append(self._started(i, start_timeout_s))
        except BaseException as exc:
            self.close()
            raise DraftProcessError(f"draft process {len(self._procs) - 1} failed to start: {exc}") from exc
        self._facts = facts
        self.max_num_seqs = sum(f.max_num_seqs for f in facts)
        self.max_model_len = min(f.max_model_len for f in facts)
        # the engine's own rule: the native drafter fits committed + k - 1 tokens, vLLM's committed + k
        self._draft_slack = int(self._call_each({0: ("can_draft", (self.max_model_len, 1))})[0] is True)
        self._home: dict[str, int] = {}                  # request id -> its process
        self._committed_len: dict[str, int] = {}         # request id -> committed tokens the process holds
        self._recent_calls: deque[list[str]] = deque(maxlen=2)   # the last two draft calls' request ids
        self.stats = FanOutStats(len(self._procs))
        self._on_lost = on_lost
        threading.Thread(target=self._watch, name="draft-process-watcher", daemon=True).start()
        logger.info("draft engine in %d processes (pids %s), %d slots in all", len(self._procs),
                    ", ".join(str(p.pid) for p in self._procs), self.max_num_seqs)

    @property
    def num_processes(self) -> int:
        return len(self._procs)

    # ---- the DraftEngine contract -------------------------------------------------------------
    def facts(self) -> EngineFacts:
        """The first process's facts with the slots of all (``max_num_seqs``, ``num_free_slots``)."""
        self._check_alive()
        return replace(self._facts[0], max_num_seqs=self.max_num_seqs, num_free_slots=self.max_num_seqs - len(self._home))

    def can_draft(self, num_committed_tokens: int, k: int) -> bool:
        """Whether a sequence of that many committed tokens fits k more (the processes' engine's rule)."""
        return num_committed_tokens + k - self._draft_slack <= self.max_model_len

    @property
    def num_active(self) -> int:
        return len(self._home)

    def add_requests(self, items: list[tuple[str, list[int], object]]) -> None:
        """Home and add ``(request id, prompt ids, params)`` requests; all or none (a process's
        refusal releases what the others added, then raises it). Raises as ``DraftEngine``."""
        self._check_alive()
        ids = [rid for rid, _, _ in items]
        check_new_ids(self._home, ids, self.max_num_seqs)
        for rid, prompt, _ in items:
            check_token_ids(rid, prompt, self._facts[0].input_vocab_size)
        homes = self._place(ids)
        parts = {i: [items[r] for r in rows] for i, rows in _rows_by_home(ids, homes).items()}
        results = self._call_each({i: ("add_requests", (part,)) for i, part in parts.items()})
        failed = [exc for exc in results.values() if isinstance(exc, BaseException)]
        if failed:
            done = {i: [rid for rid, _, _ in parts[i]] for i, r in results.items() if not isinstance(r, BaseException)}
            self._call_each({i: ("release_each", (rids,)) for i, rids in done.items() if rids})
            raise failed[0]
        self._home.update(homes)
        self._committed_len.update((rid, len(prompt)) for rid, prompt, _ in items)

    def draft(self, request_ids: list[str], committed: list[tuple[int, list[int]]], k: int | list[int]):
        """Fan the call out to the rows' processes and merge: (b rows of k_i draft ids, [b, k, V]
        draft probs or None). Refuses (no state changes anywhere) as ``DraftEngine.draft``."""
        self._check_alive()
        known_states(self._home, request_ids)
        ks = [k] * len(request_ids) if isinstance(k, int) else list(k)
        if min(ks, default=0) < 0 or len(committed) != len(request_ids) or len(ks) != len(request_ids):
            raise ValueError(f"need k >= 0 and one committed entry and k per request, got k={k}, "
                             f"{len(committed)} entries for {len(request_ids)} requests")
        lengths = [self._new_length(rid, start, ids) for rid, (start, ids) in zip(request_ids, committed)]
        too_long = [rid for rid, n, k_i in zip(request_ids, lengths, ks) if not self.can_draft(n, k_i)]
        if too_long:
            from specdec.engine.worker_base import DraftCapacityError   # heavy (the native runner): when raised

            raise DraftCapacityError(too_long, self.max_model_len)
        rows_of = _rows_by_home(request_ids, self._home)
        start = time.perf_counter()
        results = self._call_each({i: ("draft", ([request_ids[r] for r in rows], [committed[r] for r in rows],
                                                 [ks[r] for r in rows])) for i, rows in rows_of.items()})
        if failed := [exc for exc in results.values() if isinstance(exc, BaseException)]:
            raise failed[0]
        self._committed_len.update(zip(request_ids, lengths))
        self._recent_calls.append(list(request_ids))
        token_ids, probs = merge_drafts(len(request_ids), max(ks, default=0), rows_of, results)
        self.stats.add(len(request_ids), max(map(len, rows_of.values()), default=0),
                       (time.perf_counter() - start) * 1e3, max(r[2] for r in results.values()))
        return token_ids, None if probs is None else probs.to(self._facts[0].device)

    def release(self, request_id: str) -> None:
        """Forget the request in its process. Raises KeyError for an unknown id."""
        self._check_alive()
        home = self._home[request_id]
        result = self._call_each({home: ("release", (request_id,))})[home]
        del self._home[request_id], self._committed_len[request_id]
        if isinstance(result, BaseException):
            raise result

    @property
    def is_lost(self) -> bool:
        """Whether a process died or got stuck: the drafter cannot draft until it is restarted."""
        return self._broken is not None

    def close(self) -> None:
        """Stop the processes (their engines shut down as their pipes close)."""
        self._is_closing = True
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():   # stuck
                proc.kill()
                proc.join(timeout=10)

    # ---- homing, checks, calls ------------------------------------------------------------------
    def _place(self, ids: list[str]) -> dict[str, int]:
        """A process per new id: where the batch drafted two calls back (the one psd drafts next,
        which newcomers join) has the fewest rows, then the fewest requests in all."""
        batch = self._recent_calls[0] if len(self._recent_calls) == 2 else []
        in_batch = [0] * self.num_processes
        for rid in batch:
            if rid in self._home:
                in_batch[self._home[rid]] += 1
        total = [0] * self.num_processes
        for home in self._home.values():
            total[home] += 1
        slots = [f.max_num_seqs for f in self._facts]
        homes = {}
        for rid in ids:
            free = [i for i in range(self.num_processes) if total[i] < slots[i]]
            home = min(free, key=lambda i: (in_batch[i], total[i], i))
            homes[rid] = home
            in_batch[home] += 1
            total[home] += 1
        return homes

    def _new_length(self, rid: str, start: int, ids: list[int]) -> int:
        """The committed length after this call (``merge_committed``'s checks, made here first)."""
        known = self._committed_len[rid]
        if not 0 <= start <= known:
            raise ValueError(f"start_position {start} outside the known committed length {known}")
        if start + len(ids) == 0:
            raise ValueError("committed sequence is empty")
        check_token_ids(rid, ids, self._facts[0].input_vocab_size)
        return start + len(ids)

    def _call_each(self, calls: dict[int, tuple[str, tuple]]) -> dict[int, object]:
        """Send every process its call, then collect: {process: result, or the exception it raised}."""
        for i, call in calls.items():
            self._send(i, call)
        return {i: self._receive(i) for i in calls}

    def _send(self, i: int, call: tuple[str, tuple]) -> None:
        try:
            self._conns[i].send(call)
        except (OSError, ValueError) as exc:
            self._lose(i, exc)

    def _started(self, i: int, timeout_s: float) -> EngineFacts:
        """Process i's engine facts once it is built; raises what its build raised."""
        if not self._conns[i].poll(timeout_s):
            raise TimeoutError(f"no engine in {timeout_s:.0f} s")
        status, value = self._receive_raw(i)
        if status == "error":
            raise value
        return value

    def _receive(self, i: int) -> object:
        """Process i's answer: its result, or the exception its engine raised. Raises
        ``DraftProcessError`` (the process is lost) when it is gone or silent for ``call_timeout_s``."""
        if not self._conns[i].poll(self.call_timeout_s):
            self._lose(i, TimeoutError(f"no answer in {self.call_timeout_s:g} s"))
        return self._receive_raw(i)[1]

    def _receive_raw(self, i: int) -> tuple[str, object]:
        try:
            return self._conns[i].recv()
        except (EOFError, OSError) as exc:
            self._lose(i, exc)

    def _watch(self) -> None:
        """Wait for any process to exit; one that exits before ``close`` is lost."""
        ready = multiprocessing.connection.wait([proc.sentinel for proc in self._procs])
        if self._is_closing:
            return
        i = next(i for i, proc in enumerate(self._procs) if proc.sentinel in ready)
        self._procs[i].join(timeout=5)
        self._mark_lost(f"draft process {i} is gone (exit code {self._procs[i].exitcode})")

    def _lose(self, i: int, exc: BaseException):
        self._procs[i].join(timeout=5 if isinstance(exc, (EOFError, OSError)) else 0)
        self._mark_lost(f"draft process {i} is lost (exit code {self._procs[i].exitcode}): {exc!r}")
        raise DraftProcessError(self._broken) from exc

    def _mark_lost(self, reason: str) -> None:
        """The first loss sets the error every later call raises, and calls ``on_lost``."""
        with self._lost_lock:
            if self._broken is not None or self._is_closing:
                return
            self._broken = reason
        logger.error("%s; the drafter cannot draft until it is restarted", reason)
        if self._on_lost is not None:
            self._on_lost()

    def _check_alive(self) -> None:
        if self._broken is not None:
            raise DraftProcessError(self._broken)


def _rows_by_home(request_ids: list[str], homes: dict[str, int]) -> dict[int, list[int]]:
    """{process: the indexes into ``request_ids`` of the requests homed there}."""
    rows: dict[int, list[int]] = {}
    for row, rid in enumerate(request_ids):
        rows.setdefault(homes[rid], []).append(row)
    return rows
