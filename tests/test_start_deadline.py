"""``Stack.start``'s ``deadline``: the whole start-up, every start group together, ends there (a
benchmark's time budget), before each group's own ``startup_timeout_s``."""
from __future__ import annotations

import time

import pytest

from minedraft import launcher
from minedraft.launcher import RunningService, Stack, StackError
from minedraft.stack import ServiceSpec, StackConfig


class _Process:
    pid, returncode = 4242, None

    def poll(self):
        return None


@pytest.fixture
def never_serving(monkeypatch, tmp_path):
    """A Stack (startup_timeout_s 60) whose spawned services run but never report SERVING."""
    monkeypatch.setattr(launcher, "health_status", lambda address, timeout_s=2.0: 0)   # NOT_SERVING / unknown
    monkeypatch.setattr(launcher, "POLL_S", 0.01)
    monkeypatch.setattr(Stack, "_spawn", lambda self, spec: RunningService(spec, _Process(), str(tmp_path / spec.name)))
    return Stack(StackConfig(startup_timeout_s=60), run_dir=str(tmp_path))


def test_a_start_up_past_the_deadline_raises_naming_it_long_before_the_timeout(never_serving):
    t = time.monotonic()
    with pytest.raises(StackError, match=r"not SERVING by the start-up deadline: \['verifier'\]"):
        never_serving.add_services([ServiceSpec("verifier", [], "127.0.0.1:1")], deadline=t + 0.2)
    assert time.monotonic() - t < 5
    assert [s.spec.name for s in never_serving.services] == ["verifier"]   # left for stop()


def test_the_groups_own_timeout_holds_before_a_later_deadline(never_serving):
    stack = Stack(StackConfig(startup_timeout_s=0.2), run_dir=never_serving.run_dir)   # same patched _spawn
    with pytest.raises(StackError, match=r"not SERVING within 0 s: \['verifier'\]"):
        stack.add_services([ServiceSpec("verifier", [], "127.0.0.1:1")], deadline=time.monotonic() + 60)


def test_start_passes_one_deadline_to_every_start_group(monkeypatch):
    groups = [[ServiceSpec("verifier", [], "a")], [ServiceSpec("drafter", [], "b")], [ServiceSpec("gateway", [], "c")]]
    monkeypatch.setattr(launcher, "check_memory", lambda cfg, model_dir, log: None)
    monkeypatch.setattr(launcher, "build_service_specs", lambda cfg, model_dir: [s for g in groups for s in g])
    monkeypatch.setattr(launcher, "start_groups", lambda cfg, specs: groups)
    calls = []
    monkeypatch.setattr(Stack, "add_services", lambda self, specs, log=print, deadline=None: calls.append(
        ([s.name for s in specs], deadline)))
    Stack(StackConfig()).start("/m", log=lambda msg: None, deadline=123.0)
    assert calls == [(["verifier"], 123.0), (["drafter"], 123.0), (["gateway"], 123.0)]
