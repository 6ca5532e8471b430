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


def test_up_banner_prints_the_http_api_and_every_metrics_address(monkeypatch):
    monkeypatch.setattr(launcher, "Stack", _FakeStack)
    monkeypatch.setattr(launcher, "resolve_model_dir", lambda target: "/model")
    def ctrl_c(_):
        raise launcher.StopRequested(signal.SIGINT)

    monkeypatch.setattr(launcher.time, "sleep", ctrl_c)
    lines = []
    cfg = StackConfig(draft="/d", gateway_port=50051, http_port=8000, metrics_port=9090)
    assert launcher.run_until_signal(cfg, log=lines.append) == 0
    banner = "\n".join(lines)
    assert "gateway gRPC 127.0.0.1:50051" in banner and "logs /tmp/none" in banner
    assert "OpenAI HTTP API: http://127.0.0.1:8000/v1" in banner
    assert "gateway http://127.0.0.1:8000/metrics" in banner
    assert "coordinator http://127.0.0.1:9090/metrics" in banner
    assert "Ctrl-C" in banner


def test_up_banner_says_which_endpoints_are_off():
    banner = "\n".join(launcher.banner_lines(StackConfig(draft="/d", http_port=0, metrics_port=0), "runs/x"))
    assert "OpenAI HTTP API: off (--http-port 0)" in banner
    assert "gateway off" in banner and "coordinator off (--metrics-port 0)" in banner
    assert "http://" not in banner
