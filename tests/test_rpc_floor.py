"""bench.engines.rpc_floor: a real grpc.aio floor server in a child process, both call kinds timed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rpc_floor_times_unary_and_streamed_calls_against_a_child_server(tmp_path):
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, "-m", "bench.engines.rpc_floor", "--num-calls", "20", "--rows", "4",
                           "--partials", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    assert result["rows"] == 4 and result["partials"] == 2 and result["num_calls"] == 20
    for kind in ("unary", "stream"):
        parts = result[kind]
        assert 0 < parts["request_ms"] < parts["rpc_ms"] < 1000 and parts["response_ms"] > 0, (kind, parts)


def test_rpc_floor_rejects_bad_counts():
    proc = subprocess.run([sys.executable, "-m", "bench.engines.rpc_floor", "--num-calls", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--num-calls" in proc.stderr
