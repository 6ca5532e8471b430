"""engines_compare's time budget: a start-up ends at the budget's end; a system that starts too
late for its runs is reported (the benchmark of issue 24 on a device call's time limit)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from bench.engines import engines_compare
from bench.engines.engines_compare import CompareConfig


def test_a_start_up_gets_the_time_budgets_end_as_its_deadline_and_a_late_one_is_reported(tmp_path, monkeypatch):
    # session 29: a system whose start-up outran the call's limit lost every result of the call;
    # now each start-up ends at the time budget's end and is reported as a failure, the rest written
    seen = []

    class _SlowStart:
        start_deadline = None

        def __init__(self, name, cfg, logs):
            self.name = name

        def __enter__(self):
            seen.append((self.name, self.start_deadline))
            raise RuntimeError(f"{self.name}: not healthy by the start-up deadline")

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(engines_compare, "VllmServer", _SlowStart)
    monkeypatch.setattr(engines_compare, "OursServer", _SlowStart)
    data = tmp_path / "question.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "translation", "turns": ["Hi"]}) + "\n")
    cfg = CompareConfig(out_dir=str(tmp_path / "out"), data=str(data), systems=("vllm-ar", "psd-vllm"),
                        concurrencies=(1,), min_requests=1, requests_per_client=1, time_budget_s=300.0)
    before = time.monotonic()
    results = engines_compare.run_compare(cfg, "test")
    assert [name for name, _ in seen] == ["vllm-ar", "psd-vllm"]
    for _, deadline in seen:
        assert deadline is not None and before + 299 <= deadline <= time.monotonic() + 300
    assert [f["system"] for f in results["failures"]] == ["vllm-ar", "psd-vllm"]
    assert "start-up deadline" in results["failures"][1]["error"]
    assert "**FAILED** psd-vllm" in (tmp_path / "out" / "results.md").read_text()


def test_a_system_started_after_the_time_budget_ran_out_is_listed_as_not_measured(tmp_path, monkeypatch):
    # session 30: vllm-ar-v1 became healthy 2 s after the budget's end; its runs were skipped and
    # results.md showed empty tables without a word on why
    class _LateStart:
        start_deadline = None

        def __init__(self, name, cfg, logs):
            self.name = name

        def __enter__(self):
            time.sleep(max(0.0, self.start_deadline - time.monotonic()) + 0.05)   # healthy just after the budget
            return SimpleNamespace(base_url="http://127.0.0.1:1", model="m", step_log=None)

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(engines_compare, "VllmServer", _LateStart)
    data = tmp_path / "question.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "translation", "turns": ["Hi"]}) + "\n")
    cfg = CompareConfig(out_dir=str(tmp_path / "out"), data=str(data), systems=("vllm-ar-v1",), num_warmup=0,
                        concurrencies=(16, 64), min_requests=1, max_requests=1, time_budget_s=0.5)
    results = engines_compare.run_compare(cfg, "test")
    assert [(r["concurrency"], r["skipped"]) for r in results["runs"]] == [(16, "time budget"), (64, "time budget")]
    assert all(r["startup_s"] >= 0.5 for r in results["runs"])
    text = (tmp_path / "out" / "results.md").read_text()
    assert "**NOT MEASURED** vllm-ar-v1 at c = 16, 64: time budget (its start-up took" in text
