"""``bench.engines.parallel_drafters`` on vLLM's CPU build (run in ``.venv-vllm``): one draft call
of R rows in one process against R / P rows in each of P processes started at one barrier."""
from __future__ import annotations

import json

import pytest

from bench.engines import parallel_drafters

TINY = ["--device", "cpu", "--dtype", "float32", "--draft", "random:tiny-llama-hd64", "--enforce-eager",
        "--k", "2", "--num-calls", "2", "--num-warmup", "1", "--max-model-len", "128"]


def test_one_and_two_processes_run_and_a_call_lasts_as_long_as_its_slowest_process(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path / "cache"))   # the spawned processes inherit it
    out = tmp_path / "out"
    assert parallel_drafters.main(TINY + ["--rows", "4", "--processes", "1,2", "--out-dir", str(out)]) == 0
    one, two = json.loads((out / "results.json").read_text())["points"]
    assert (one["processes"], one["rows_per_process"], two["processes"], two["rows_per_process"]) == (1, 4, 2, 2)
    assert len(two["process_ms_per_call"]) == 2 and two["steps_per_call"] == 2.0   # k engine steps a call
    for point in (one, two):
        assert point["ms_per_call"] >= max(point["process_ms_per_call"]) - 1e-9 > 0
    assert "| 2 | 2 |" in (out / "results.md").read_text()
    (first_start, first_end), (second_start, second_end) = sorted(two["engine_start_spans"])
    assert first_end <= second_start   # one engine start at a time (vLLM sizes its KV cache from free memory)


def test_the_slowest_process_sets_each_calls_time_and_a_failed_process_fails_the_point() -> None:
    points = [{"call_ms": [10.0, 30.0], "ms_per_call": 20.0, "first_step_ms": 4.0, "later_step_ms": 2.0,
               "steps_per_call": 4.0, "engine_start_s": 5.0, "engine_start_span": (0.0, 5.0)},
              {"call_ms": [20.0, 10.0], "ms_per_call": 15.0, "first_step_ms": 6.0, "later_step_ms": 3.0,
               "steps_per_call": 4.0, "engine_start_s": 7.0, "engine_start_span": (5.0, 12.0)}]
    point = parallel_drafters.summarize(2, 32, points)
    assert point["ms_per_call"] == pytest.approx(25.0) and point["ms_per_call_min"] == pytest.approx(20.0)
    assert point["first_step_ms"] == pytest.approx(5.0) and point["engine_start_s"] == 7.0
    failed = parallel_drafters.summarize(2, 32, [points[0], {"error": "RuntimeError: no KV cache"}])
    assert failed == {"processes": 2, "rows": 32, "errors": ["RuntimeError: no KV cache"]}


def test_a_process_that_dies_without_reporting_fails_its_point(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(parallel_drafters, "_child", _crash)   # spawn pickles the patched name's target
    monkeypatch.setattr(parallel_drafters, "POLL_S", 0.2)
    a = parallel_drafters._parse(TINY + ["--rows", "4", "--processes", "2", "--out-dir", str(tmp_path)])
    point = parallel_drafters.run(a, 2, "unused", "dummy")
    assert point["processes"] == 2 and point["errors"] and all("exited with code 3" in e for e in point["errors"])


def _crash(*args) -> None:
    import os
    os._exit(3)


@pytest.mark.parametrize("processes", ["3", "0", "1,5"])
def test_process_counts_must_divide_the_rows(processes) -> None:
    with pytest.raises(SystemExit):
        parallel_drafters._parse(TINY + ["--rows", "4", "--processes", processes, "--out-dir", "x"])
