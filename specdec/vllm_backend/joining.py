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
