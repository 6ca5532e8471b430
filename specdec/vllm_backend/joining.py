"""Requests that join a multi-step decode call while it runs (``VllmTargetWorker``; thread-safe).

vLLM's continuous batching admits a new request between two engine steps: its prefill runs in
the same step as the running requests' decode. ``VllmTargetWorker.decode`` runs N decode steps
in one call, so a request that arrives meanwhile would wait for the whole call (its TTFT grows by
up to N decode steps, and the call's rows wait for its separate prefill call afterwards).
``CallJoins`` lets the service thread hand such a request to the call in progress: between two of
its engine steps the call adds it to the engine (its prefill beside the rows' next decode step),
resolves its future with the first token at once, and lets it decode with the call's rows for
their remaining steps; the call returns those tokens after its rows' (``VllmTargetWorker.verify``).
Joins that arrive as the call ends are prefilled by the call before it returns.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass
class Join:
    """One AddRequests batch handed to a running call: (request id, prompt token ids, sampling
    params) per request, and the future of their ``StepOutput``s (all or none: an error fails
    the batch)."""

    items: list
    future: Future = field(default_factory=Future)


class CallJoins:
    """The joins waiting for the running call's next step boundary (see module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Join] = []
        self._is_open = False

    def submit(self, items: list) -> Future | None:
        """Any thread: the future of ``items``' first-token ``StepOutput``s if a call is running
        and takes them, else None (the caller adds them itself, after the call)."""
        with self._lock:
            if not self._is_open:
                return None
            join = Join(list(items))
            self._pending.append(join)
            return join.future

    def open(self) -> None:
        """The engine thread: a call that takes joins starts."""
        with self._lock:
            self._is_open = True

    def has_pending(self) -> bool:
        """The engine thread: whether a join waits (a read without the lock: one submitted
        meanwhile is seen at the next step boundary)."""
        return bool(self._pending)

    def take(self) -> list[Join]:
        """The engine thread: the joins submitted since the last ``take``."""
        with self._lock:
            pending, self._pending = self._pending, []
            return pending

    def close(self) -> list[Join]:
        """The engine thread: the call ends; returns the joins it has not taken yet."""
        with self._lock:
            self._is_open = False
            pending, self._pending = self._pending, []
            return pending


class JoiningCallsMixin:
    """``VllmTargetWorker``'s side of joins: a running multi-step call takes the submitted joins
    between two of its steps, resolves each once its requests have their first token, and fails
    them with the call. Uses the worker's ``_joins`` (``CallJoins``), ``_requests``, ``_names``, ``scheduler``,
    ``engine``, ``_add_to_engine``, ``_first_tokens`` and ``add_requests``."""

    def _take_joins(self, num_steps_left: int, ends) -> list[tuple[Join, dict]]:
        # ends: the call's ``specdec.vllm_backend.row_ends.RowEnds``
        """Add the submitted joins to the engine and to the running step: each request samples
        as many tokens as the call's rows have steps left (at least its first, at most its
        ``max_tokens``), and ``ends`` watches it (its quota, its stop tokens). A
        refused batch fails alone (its future gets the error)."""
        taken = []
        for join in self._joins.take():
            try:
                added = self._add_to_engine(join.items)
            except BaseException as exc:
                join.future.set_exception(exc)
                continue
            new = {rid: max(1, min(num_steps_left, state.params.max_tokens)) for rid, state in added.items()}
            ends.add(added)
            self.scheduler.join({added[rid].vllm_id: n for rid, n in new.items()})
            taken.append((join, added))
        return taken

    def _resolve_joins(self, joined: list, merged: dict) -> list:
        """Resolve each join whose requests all have their first token; returns the others."""
        waiting = []
        for join, added in joined:
            if all(rid in merged and merged[rid].token_ids for rid in added):
                join.future.set_result(self._first_tokens(join.items, added, merged))
            else:
                waiting.append((join, added))
        return waiting

    def _fail_joins(self, joined: list, exc: BaseException) -> None:
        """The call failed: its joins fail with it, their requests leave the engine."""
        for join, added in joined:
            for rid, state in added.items():
                self._requests.pop(rid, None)
                self._names.pop(state.vllm_id, None)
            with contextlib.suppress(Exception):  # the engine itself may be what failed
                if added:
                    self.engine.abort_request([state.vllm_id for state in added.values()], internal=True)
            join.future.set_exception(exc)

    def _add_late(self, late: list[Join]) -> None:
        """Joins submitted as the call ended: prefilled now, each batch on its own."""
        for join in late:
            try:
                join.future.set_result(self.add_requests(join.items))
            except BaseException as exc:
                join.future.set_exception(exc)
