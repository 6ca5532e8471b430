"""``bench.cpu.cpu_step_stack.account``: a run's wall time split into verify, step overhead,
admission gaps and other gaps (issue 8 profile of our ar through the service stack)."""

from __future__ import annotations

import pytest

from bench.cpu.cpu_step_stack import account

T0 = 1_000.0  # Unix s


def step(start_s: float, wall_ms: float, verify_ms: float, ids: list[str]) -> dict:
    return {"start_s": start_s, "wall_ms": wall_ms, "verify_ms": verify_ms, "request_ids": ids,
            "num_verify": len(ids), "num_emitted_tokens": len(ids)}


def test_parts_add_up_and_admissions_are_the_gaps_before_new_requests():
    requests = [{"start_s": T0, "end_s": T0 + 3.0, "num_output_tokens": 4},
                {"start_s": T0, "end_s": T0 + 3.2, "num_output_tokens": 2}]
    steps = [step(T0 - 5.0, 100, 90, ["warm"]),                # warm-up: outside the window
             step(T0 + 1.0, 200, 150, ["a"]),                  # 1.0 s admission gap before
             step(T0 + 1.2, 200, 150, ["a"]),                  # back to back
             step(T0 + 2.0, 300, 250, ["a", "b"]),             # 0.6 s gap: b admitted
             step(T0 + 2.5, 100, 80, ["b"])]                   # 0.2 s gap, nobody new
    parts = account(requests, steps)
    assert parts["num_steps"] == 4 and parts["num_admission_gaps"] == 2 and parts["num_admitted"] == 2
    assert parts["verify_ms"] == pytest.approx(630.0)
    assert parts["step_overhead_ms"] == pytest.approx(170.0)
    assert parts["admission_gap_ms"] == pytest.approx(1600.0)
    assert parts["other_gap_ms"] == pytest.approx(200.0 + 600.0)  # + tail after the last step
    total = sum(parts[k] for k in ("verify_ms", "step_overhead_ms", "admission_gap_ms", "other_gap_ms"))
    assert total == pytest.approx(parts["wall_ms"]) == pytest.approx(3200.0)
    assert parts["output_tokens_per_s"] == pytest.approx(6 / 3.2, abs=0.01)


def test_no_step_in_the_window_is_an_error():
    with pytest.raises(ValueError, match="steps"):
        account([{"start_s": T0, "end_s": T0 + 1, "num_output_tokens": 1}], [step(T0 - 9, 1, 1, ["x"])])
    with pytest.raises(ValueError, match="requests"):
        account([], [])
