"""``minedraft up``'s restart budget (``restart_exited``) over fake processes: a drafter out of
restarts is left down while the stack serves on; other services out of restarts, or not
restartable, end ``minedraft up``; a service that stays up gets its budget back."""

from __future__ import annotations

import pytest

from minedraft import launcher
from minedraft.launcher import MAX_RESTARTS, RunningService, Stack, StackError, restart_exited
from minedraft.stack import ServiceSpec, StackConfig

NAMES = ("verifier", "drafter", "coordinator", "gateway")


class _Process:
    """A child process whose exit the test decides."""

    def __init__(self) -> None:
        self.pid, self.returncode = 4242, None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout=None) -> int | None:
        return self.returncode


@pytest.fixture
def stack(monkeypatch, tmp_path):
    """A Stack of fake services that all serve; a restart spawns a fresh (running) fake process."""
    monkeypatch.setattr(launcher, "health_status", lambda address, timeout_s=2.0: 1)  # SERVING
    monkeypatch.setattr(launcher, "POLL_S", 0.0)
    monkeypatch.setattr(launcher, "_signal_group", lambda process, sig: None)
    monkeypatch.setattr(Stack, "_spawn", lambda self, spec: RunningService(spec, _Process(), str(tmp_path / spec.name)))
    stack = Stack(StackConfig(draft="/d", startup_timeout_s=5), run_dir=str(tmp_path))
    stack.services = [RunningService(ServiceSpec(name, [], f"127.0.0.1:{i}"), _Process(), str(tmp_path / name), True)
                      for i, name in enumerate(NAMES)]
    return stack


def _kill(stack: Stack, name: str) -> None:
    stack.service(name).process.returncode = 1


def test_a_drafter_out_of_restarts_stays_down_and_the_stack_keeps_serving(stack):
    restarts, lines = {}, []
    for _ in range(MAX_RESTARTS):
        _kill(stack, "drafter")
        assert restart_exited(stack, restarts, lines.append) == ["drafter"]
    _kill(stack, "drafter")  # the sixth death
    assert restart_exited(stack, restarts, lines.append) == []
    assert f"warning: drafter gave up after {MAX_RESTARTS} restarts; serving without speculation" in lines[-1]
    num_lines = len(lines)
    launcher._restart_or_raise(stack, restarts, lines.append)  # later passes: no restart, no error
    assert restart_exited(stack, restarts, lines.append) == [] and len(lines) == num_lines
    _kill(stack, "coordinator")  # the given-up drafter does not block other restarts
    assert restart_exited(stack, restarts, lines.append) == ["coordinator"]
    stack.check_alive()


@pytest.mark.parametrize("name", ["verifier", "gateway"])
def test_a_dead_verifier_or_gateway_still_ends_minedraft_up(stack, name):
    _kill(stack, name)
    with pytest.raises(StackError, match=f"{name} exited"):
        launcher._restart_or_raise(stack, {}, lambda line: None)


def test_a_coordinator_out_of_restarts_still_ends_minedraft_up(stack):
    restarts = {}
    for _ in range(MAX_RESTARTS):
        _kill(stack, "coordinator")
        restart_exited(stack, restarts, lambda line: None)
    _kill(stack, "coordinator")
    with pytest.raises(StackError, match="coordinator exited"):
        launcher._restart_or_raise(stack, restarts, lambda line: None)


def test_a_service_up_for_stable_s_gets_its_restart_budget_back(stack, monkeypatch):
    restarts = {}
    for _ in range(MAX_RESTARTS):
        _kill(stack, "coordinator")
        restart_exited(stack, restarts, lambda line: None)
    stack.service("coordinator").started_at -= launcher.STABLE_S  # it has served that long since
    assert restart_exited(stack, restarts, lambda line: None) == [] and "coordinator" not in restarts
    _kill(stack, "coordinator")
    assert restart_exited(stack, restarts, lambda line: None) == ["coordinator"] and restarts == {"coordinator": 1}


def test_stop_does_not_signal_a_given_up_drafter(stack, monkeypatch):
    signalled = []
    monkeypatch.setattr(launcher, "_signal_group", lambda process, sig: signalled.append((process, sig)))
    restarts = {}
    for _ in range(MAX_RESTARTS + 1):
        _kill(stack, "drafter")
        restart_exited(stack, restarts, lambda line: None)
    drafter = stack.service("drafter").process
    assert signalled == [(drafter, launcher.signal.SIGKILL)]   # once, at give-up: its group's stragglers
    signalled.clear()
    stack.stop()
    assert signalled and all(process is not drafter for process, _ in signalled) and not stack.services


def test_a_coordinator_restarted_after_the_drafter_gave_up_runs_in_ar(stack):
    restarts = {}
    _kill(stack, "coordinator")
    restart_exited(stack, restarts, lambda line: None)
    assert stack.service("coordinator").spec.argv == []          # before: its original command line
    for _ in range(MAX_RESTARTS + 1):
        _kill(stack, "drafter")
        restart_exited(stack, restarts, lambda line: None)
    _kill(stack, "coordinator")
    lines = []
    assert restart_exited(stack, restarts, lines.append) == ["coordinator"]
    argv = stack.service("coordinator").spec.argv
    assert argv[argv.index("--mode") + 1] == "ar" and any("restarts in ar" in line for line in lines)
    assert argv[argv.index("--max-num-seqs") + 1] == str(stack.cfg.num_engine_slots)   # psd's 2m, all of them
