"""``minedraft up``'s supervision loop (``run_until_signal``) without real services."""

from __future__ import annotations

import signal

from minedraft import launcher
from minedraft.stack import StackConfig


class _FakeStack:
    def __init__(self, cfg):
        self.services, self.run_dir, self.stopped = [], "/tmp/none", False

    def start(self, model_dir, log):
        pass

    def stop(self):
        _FakeStack.stopped = True


def test_up_supervises_until_a_signal_then_stops_with_status_0(monkeypatch):
    passes = []

    def fake_sleep(_):
        passes.append(1)
        if len(passes) == 3:
            raise launcher.StopRequested(signal.SIGTERM)

    monkeypatch.setattr(launcher, "Stack", _FakeStack)
    monkeypatch.setattr(launcher, "resolve_model_dir", lambda target: "/model")
    monkeypatch.setattr(launcher.time, "sleep", fake_sleep)
    lines = []
    assert launcher.run_until_signal(StackConfig(draft="/d"), log=lines.append) == 0
    assert len(passes) == 3 and _FakeStack.stopped and lines[-1] == "shutting down"
