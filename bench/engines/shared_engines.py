"""Our speculative systems that run the same engines share one start of them (``bench.engines.engines_compare``).

Starting a system costs more than measuring it: on the GPU host one vLLM engine start is 1-2
minutes (imports, engine-core spawn, torch.compile, CUDA graphs; BENCHMARKS.md "Leases") and psd's
verifier and drafter start one after the other, about 4 minutes, against 5-20 s per concurrency
measured. A 30-minute device lease could so measure only about five systems. But ``sd``, ``psd``
and ``auto`` differ only in the coordinator: on one engine backend, with the same engine-side
flags (``engine_key``), their verifier and drafter are the same processes with the same
arguments. Such systems are grouped (``group_systems``); a group's engines start once, and
each system gets its own coordinator and gateway in front of them (a few seconds), as
``bench.gpu.gpu_stack`` does for the native engines' modes.

The engines are started with psd's shape, ``2m`` KV slots (``StackConfig.num_engine_slots`` of
``max_num_seqs = m``). ``sd``'s coordinator runs one batch of ``2m`` on them, as a coordinator
restarted in ``ar`` does (``minedraft.launcher.Stack.restart``), and ``psd`` / ``auto`` two
batches of ``m``: every system keeps at most 2m requests resident, as when started alone (where
``sd``'s engines get 4m slots it never fills). Each coordinator drains on SIGTERM and frees its
requests' KV; the next one frees whatever an earlier one left (``coordinator.server``). vLLM's
prefix cache keeps the prompts of the systems before, as it keeps a system's own prompts from one
concurrency to the next (each concurrency reuses the first prompts of the same list).
``ar`` is never grouped: its verifier is a plain-decoding engine (``--num-speculative-tokens 0``;
on vLLM 0.24 Model Runner V2), not the speculative one.
"""
from __future__ import annotations

import os
from dataclasses import replace
from unittest import mock

from bench.common.systems import Endpoint, OursSystem
from bench.engines.compare_systems import SystemName, our_stack_config, parse_system

ENGINE_SERVICES = ("verifier", "drafter")


def engine_key(system: SystemName) -> tuple | None:
    """What the engine services of ``system`` depend on; None for systems that share no engines
    (vLLM's own servers, ours ``ar``). Two systems with the same key run on the same engines."""
    if system.family != "ours" or system.mode == "ar":
        return None
    return (system.engine, system.draft_sessions, system.draft_proposer, system.draft_processes,
            system.verifier_sm_percent, system.model_runner_v1)


def group_systems(names: tuple[str, ...] | list[str]) -> list[tuple[str, ...]]:
    """``names`` as start groups in order of first appearance: the systems of one ``engine_key``
    join the first one's group, every other system is a group of its own.

    Raises:
        ValueError: a name is no system (``parse_system``), or appears twice.
    """
    if len(set(names)) != len(names):
        raise ValueError(f"systems: each system once, got {list(names)}")
    groups: list[list[str]] = []
    by_key: dict[tuple, list[str]] = {}
    for name in names:
        key = engine_key(parse_system(name))
        if key is not None and key in by_key:
            by_key[key].append(name)
            continue
        groups.append([name])
        if key is not None:
            by_key[key] = groups[-1]
    return [tuple(group) for group in groups]


class SharedEngines:
    """The verifier and drafter of a group's systems, started once (a context manager); ``front``
    puts one system's coordinator and gateway in front of them.

    Args:
        names: the group (``group_systems``); cfg: the ``CompareConfig``; logs_dir: the engines' logs.
    Raises (on enter):
        StackError: an engine died or was not SERVING in time (by ``start_deadline``, when set).
        InsufficientMemoryError: the models and KV caches do not fit (nothing started).
    """

    start_deadline: float | None = None  # time.monotonic() by which the start-up must be done (a time budget)

    def __init__(self, names: tuple[str, ...], cfg, logs_dir: str) -> None:  # noqa: D107 -- see the class docstring
        from minedraft.launcher import Stack, resolve_model_dir

        os.makedirs(logs_dir, exist_ok=True)
        self._system = parse_system(names[0])
        self._cfg = cfg
        self.stack_cfg = our_stack_config(replace(self._system, mode="psd"), cfg, logs_dir, "")
        self.model_dir = resolve_model_dir(cfg.target)
        self._stack = Stack(self.stack_cfg, run_dir=logs_dir)

    def __enter__(self) -> "SharedEngines":
        from minedraft.capacity import check_memory
        from minedraft.launcher import start_groups
        from minedraft.stack import build_service_specs

        specs = build_service_specs(self.stack_cfg, self.model_dir)
        groups = [[s for s in group if s.name in ENGINE_SERVICES] for group in start_groups(self.stack_cfg, specs)]
        try:
            check_memory(self.stack_cfg, self.model_dir, log=lambda msg: None)
            with mock.patch.dict(os.environ, self._system.engine_env):
                for group in filter(None, groups):
                    self._stack.add_services(group, log=lambda msg: None, deadline=self.start_deadline)
        except BaseException:
            self._stack.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.stop()

    def check_alive(self) -> None:
        """Raises StackError (with the log tail) when an engine has exited."""
        self._stack.check_alive()

    def front(self, name: str, logs_dir: str) -> "Front":
        """System ``name``'s coordinator and gateway in front of these engines (not yet started).

        Raises:
            ValueError: ``name`` does not run on these engines (another ``engine_key``).
        """
        system = parse_system(name)
        if engine_key(system) != engine_key(self._system):
            raise ValueError(f"systems: {name!r} does not run on the engines of {self._system}")
        os.makedirs(logs_dir, exist_ok=True)
        step_log = os.path.join(logs_dir, "steps.jsonl")
        own = our_stack_config(system, self._cfg, logs_dir, step_log)
        engines = self.stack_cfg
        front_cfg = replace(own, verifier_port=engines.verifier_port, drafter_port=engines.drafter_port,
                            dist_port=engines.dist_port)
        return Front(front_cfg, self.model_dir, logs_dir)


class Front(OursSystem):
    """One system's coordinator and gateway in front of running engines: ``OursSystem`` (its
    ``endpoint``, ``start_deadline``, ``metrics`` and stop) with only the front services started."""

    def __init__(self, cfg, model_dir: str, logs_dir: str) -> None:  # noqa: D107 -- see the class docstring
        from minedraft.launcher import Stack

        self._cfg = cfg
        self._model_dir = model_dir
        self._stack = Stack(cfg, run_dir=logs_dir)
        self.endpoint = Endpoint(f"http://127.0.0.1:{cfg.http_port}/v1", os.path.basename(os.path.normpath(cfg.target)),
                                 cfg.step_log, logs_dir)

    def __enter__(self) -> Endpoint:
        from minedraft.stack import build_service_specs

        coordinator, gateway = build_service_specs(self._cfg, self._model_dir)[-2:]
        try:
            self._stack.add_services([coordinator, gateway], log=lambda msg: None, deadline=self.start_deadline)
        except BaseException:
            self._stack.stop()
            raise
        return self.endpoint
