"""How a draft call's time is counted (``bench.engines.draft_calls``, ``bench.engines.parallel_drafters``):
``Timed`` wraps an engine's admission and engine-core steps, ``profiled_ms`` reads vLLM's parts of a
call out of a cProfile run."""
from __future__ import annotations

import time


class Timed:
    """Wraps an engine's ``add_request`` and its engine core's step (``engine_core.get_output``,
    what the drafters read through ``core_step``; counted as ``step``) to count calls and seconds."""

    def __init__(self, engine) -> None:
        self.seconds = {"add_request": 0.0, "step": 0.0}
        self.calls = {"add_request": 0, "step": 0}
        self.step_ms: list[float] = []   # each step's ms since the last ``reset`` / ``end_call``
        self.first_step_ms: list[float] = []   # per call: its first step (the catch-up)
        self.later_step_ms: list[float] = []   # per call: its other steps (decode)
        for name, owner, attr in (("add_request", engine, "add_request"), ("step", engine.engine_core, "get_output")):
            setattr(owner, attr, self._wrap(name, getattr(owner, attr)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t
                self.seconds[name] += seconds
                self.calls[name] += 1
                if name == "step":
                    self.step_ms.append(seconds * 1e3)
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)
        self.step_ms, self.first_step_ms, self.later_step_ms = [], [], []

    def end_call(self) -> None:
        """File the steps since the last call under first / later steps."""
        if self.step_ms:
            self.first_step_ms.append(self.step_ms[0])
            self.later_step_ms += self.step_ms[1:]
        self.step_ms = []


PROFILED = (   # (file suffix, function): where a draft call's time goes inside vLLM (0.24 and 0.32 alike)
    ("v1/engine/llm_engine.py", "add_request"), ("v1/request.py", "__init__"),
    ("v1/core/sched/scheduler.py", "schedule"), ("v1/core/kv_cache_manager.py", "get_computed_blocks"),
    ("v1/core/kv_cache_manager.py", "allocate_slots"), ("v1/core/kv_cache_manager.py", "free"),
    ("v1/core/sched/scheduler.py", "update_from_output"), ("v1/worker/gpu_model_runner.py", "execute_model"),
    ("v1/worker/gpu_model_runner.py", "_model_forward"),
    # a resumed draft session (``sessions``): the scheduler's update, then the request handed to the
    # runner again with all its tokens (V1 runner: ``_update_states``; Model Runner V2, the drafter's on
    # CUDA with vLLM 0.24: ``add_requests`` removes and re-adds it, ``finish_requests`` when it stops)
    ("v1/core/sched/scheduler.py", "_update_request_as_session"), ("v1/core/sched/output.py", "from_request"),
    ("v1/worker/gpu_model_runner.py", "_update_states"), ("v1/worker/gpu/model_runner.py", "add_requests"),
    ("v1/worker/gpu/model_runner.py", "finish_requests"), ("v1/worker/gpu/model_runner.py", "execute_model"))


def profiled_ms(profile, num_calls: int) -> dict[str, float]:
    """Cumulative ms per call of each ``PROFILED`` function (absent ones left out)."""
    import pstats

    totals: dict[str, float] = {}
    for (path, _, name), (_, _, _, cumulative, _) in pstats.Stats(profile).stats.items():
        for suffix, function in PROFILED:
            if name == function and path.endswith(suffix):
                key = f"{suffix.rsplit('/', 1)[-1]}:{function}"
                totals[key] = totals.get(key, 0.0) + cumulative * 1e3 / num_calls
    return totals
