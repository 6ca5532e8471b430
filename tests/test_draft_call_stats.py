"""``specdec.vllm_backend.call_stats``: the vLLM drafter's per-call split (torch-free, no vLLM)."""
from __future__ import annotations

import logging

import pytest

from specdec.vllm_backend import call_stats
from specdec.vllm_backend.call_stats import CallSplit, DraftCallStats, row_bucket, summarize


@pytest.mark.parametrize("rows, bucket", [(1, "rows<=1"), (2, "rows<=2"), (3, "rows<=4"), (32, "rows<=32"),
                                          (33, "rows<=64"), (64, "rows<=64"), (65, "rows>64")])
def test_row_buckets(rows, bucket):
    assert row_bucket(rows) == bucket


def test_summary_medians_per_bucket_and_other_time_is_what_no_part_explains():
    calls = [CallSplit(30, 30.0, 3.0, 8.0, (4.0, 4.0, 4.0)), CallSplit(32, 32.0, 4.0, 9.0, (5.0, 5.0, 5.0)),
             CallSplit(31, 40.0, 5.0, 10.0, (6.0, 6.0, 6.0)), CallSplit(1, 10.0, 0.5, 3.0, (2.0,))]
    summary = summarize(calls)
    assert list(summary) == ["rows<=1", "rows<=32"]
    big = summary["rows<=32"]
    assert big["calls"] == 3 and big["rows"] == 31 and big["total_ms"] == 32.0
    assert big["admit_ms"] == 4.0 and big["first_step_ms"] == 9.0 and big["later_steps"] == 3
    assert big["later_step_ms"] == 5.0 and big["other_ms"] == pytest.approx(7.0)   # median of 7, 4, 7
    assert summary["rows<=1"]["other_ms"] == pytest.approx(4.5)


def test_a_call_is_split_at_its_marks_and_logged_every_n_calls(monkeypatch, caplog):
    clock = iter([0.0, 0.0005, 0.0025, 0.0105, 0.0135, 0.0165, 0.0195, 0.020] * 2)
    monkeypatch.setattr(call_stats.time, "perf_counter", lambda: next(clock))
    stats = DraftCallStats(log_every=2)
    with caplog.at_level(logging.INFO, logger=call_stats.__name__):
        for _ in range(2):
            stats.start(8)
            stats.admitting()
            stats.admitted()
            for _ in range(4):
                stats.stepped()
            stats.end()
    assert stats.calls == []                      # filed, then logged and cleared
    med = stats.last_summary["rows<=8"]
    assert med["admit_ms"] == pytest.approx(2.0) and med["first_step_ms"] == pytest.approx(8.0)
    assert med["later_steps"] == 3 and med["later_step_ms"] == pytest.approx(3.0)
    assert med["total_ms"] == pytest.approx(20.0) and med["other_ms"] == pytest.approx(1.0)   # 0.5 before, 0.5 after
    assert "draft calls (last 2): rows<=8: 2 calls" in caplog.text


def test_log_every_zero_keeps_nothing_and_negative_is_refused():
    stats = DraftCallStats(log_every=0)
    stats.start(4)
    stats.stepped()
    stats.end()
    assert stats.calls == [] and stats.last_summary == {}
    with pytest.raises(ValueError, match="log_every"):
        DraftCallStats(log_every=-1)
    with pytest.raises(ValueError, match="log_every_s"):
        DraftCallStats(log_every_s=0.0)


def test_a_window_is_also_logged_after_log_every_s_once_it_holds_enough_calls(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(call_stats.time, "monotonic", lambda: now[0])
    stats = DraftCallStats(log_every=1000, log_every_s=10.0)
    for i in range(call_stats.MIN_CALLS_LOGGED + 2):
        now[0] = 11.0 if i == 2 else now[0]   # due from the third call on, but 10 calls are needed
        stats.start(4)
        stats.stepped()
        stats.end()
        assert (stats.last_summary != {}) == (i + 1 >= call_stats.MIN_CALLS_LOGGED), i
        if stats.last_summary:
            break
    assert stats.calls == [] and stats.last_summary["rows<=4"]["calls"] == call_stats.MIN_CALLS_LOGGED
