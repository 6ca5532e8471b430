"""The draft process's side of ``drafter_svc.processes.DraftProcesses``: build the engine, then
answer the parent's calls over a pipe."""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from typing import Callable

PARENT_POLL_S = 1.0   # how often a draft process checks that the drafter is still there


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (the parent re-raises it), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:   # noqa: BLE001 -- e.g. an exception class whose __init__ takes other arguments
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve_engine(build: Callable[[], object], conn, log_level: str, parent_pid: int) -> None:
    """A draft process of the drafter ``parent_pid``: build the engine, report its facts, then run
    ``(method, args)`` calls until the parent closes the pipe."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="parent-watcher", daemon=True).start()
    try:
        engine = build()
        conn.send(("ok", engine.facts()))
    except BaseException as exc:   # noqa: BLE001 -- reported; the parent raises it
        conn.send(("error", _portable(exc)))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):   # the parent is gone
            return
        try:
            if method == "release_each":   # an add's rollback
                conn.send(("ok", [engine.release(rid) for rid in args[0]]))
            elif method == "draft":   # draft probs through host memory (a CUDA tensor would need CUDA IPC)
                start = time.perf_counter()
                token_ids, probs = engine.draft(*args)
                probs = None if probs is None else probs.cpu()
                conn.send(("ok", (token_ids, probs, (time.perf_counter() - start) * 1e3)))
            else:
                conn.send(("ok", getattr(engine, method)(*args)))
        except Exception as exc:   # noqa: BLE001 -- the engine's errors (KeyError, ValueError, ...) go back
            conn.send(("error", _portable(exc)))


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the drafter is gone (re-parented; also when it died before this process
    got here), even in the middle of an engine build or a call: a GPU engine left behind would hold
    memory a restarted drafter needs."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)
