"""bench/load/load_sweep.py end to end on tiny models (its CPU twin, real processes), the bursty trace,
configuration names and the report's analysis."""
from __future__ import annotations

import json
import os

import pytest

from bench.load.load_sweep import main
from bench.load.load_sweep_cli import parse_args, parse_config
from bench.load.load_sweep_report import SweepReport, compare_tokens
from bench.common.loadgen import BurstConfig, bursty_arrivals
from minedraft.client import GenerationResult
from minedraft.v1 import common_pb2
from test_e2e_stack import model_dirs  # noqa: F401  (module fixture: tiny target + draft with the SmolLM2 tokenizer)

PROMPTS = [("1", "writing", "Write a haiku about the sea."), ("2", "translation", "Translate to French: good morning"),
           ("3", "qa", "What is the capital of Italy?"), ("4", "roleplay", "Pretend you are a pirate. Say hello.")]
CONFIGS = "ar-m2,auto-k3-m2-adaptive-feedback"  # the e2e twin: a fixed baseline and auto (process start-up dominates)


def test_bursty_trace_is_deterministic_and_bursty():
    cfg = BurstConfig(num_bursts=3, min_burst_size=5, max_burst_size=9, burst_spread_s=0.2, min_gap_s=1.0,
                      max_gap_s=2.0, num_trickle=2)
    a, b, other = bursty_arrivals(cfg, 7), bursty_arrivals(cfg, 7), bursty_arrivals(cfg, 8)
    assert a == b and a != other
    assert a == sorted(a) and a[0] == 0.0
    assert 3 * 5 + 2 * 2 <= len(a) <= 3 * 9 + 2 * 2
    gaps = [later - earlier for earlier, later in zip(a, a[1:])]
    assert max(gaps) >= 1.0 / 3 and sorted(gaps)[len(gaps) // 2] < 0.2   # quiet gaps between dense bursts
    with pytest.raises(ValueError, match="max_burst_size"):
        BurstConfig(min_burst_size=4, max_burst_size=3)


def test_config_names():
    c = parse_config("auto-k4-m16-adaptive-feedback")
    assert (c.mode, c.k, c.m, c.k_policy, c.balancer, c.is_fixed, c.max_num_running) == \
        ("auto", 4, 16, "adaptive", "feedback", False, 32)
    assert parse_config("ar-m32").is_fixed and parse_config("sd-k2-m4").max_num_running == 4
    assert parse_config("ar-m32").max_num_batched_tokens is None
    assert parse_config("ar-m32-b0").max_num_batched_tokens == 0 and parse_config("psd-k2-m4-b512").k == 2
    for bad in ("ar-k2-m4", "sd-m4", "psd-k2-m4-fast", "xx-k2-m4"):
        with pytest.raises(ValueError):
            parse_config(bad)


def _result(tokens: list[int]) -> GenerationResult:
    return GenerationResult(token_ids=tokens, usage=common_pb2.Usage(completion_tokens=len(tokens)), ttft_s=0.1,
                            latency_s=1.0)


def test_report_best_fixed_and_goals(tmp_path):
    configs = tuple(parse_config(n) for n in ("ar-m4", "sd-k4-m4", "psd-k4-m4-adaptive", "auto-k4-m4"))
    report = SweepReport(str(tmp_path), {"temperature": 0}, configs)
    tps = {"ar-m4": (100, 50), "sd-k4-m4": (80, 60), "psd-k4-m4-adaptive": (150, 90), "auto-k4-m4": (98, 70)}
    for name, values in tps.items():
        for (label, kind), value in zip((("c4", "closed"), ("bursty", "open")), values):
            tokens = [1, 2, 3] if name != "sd-k4-m4" else [1, 2, 4]
            report.add(configs[[c.name for c in configs].index(name)], label,
                       {"output_tokens_per_s": value, "kind": kind, "concurrency": 4 if kind == "closed" else 0},
                       [_result(tokens)])
    analysis = report.analysis()
    assert analysis["per_point"]["c4"]["best_fixed"] == "ar-m4"
    assert analysis["per_point"]["bursty"]["best_fixed"] == "sd-k4-m4"
    assert analysis["per_point"]["c4"]["auto-k4-m4/best_fixed"] == pytest.approx(0.98)
    goals = analysis["goals"]
    assert goals["auto-k4-m4: within 3% of the best fixed at every load point"]["met"]
    assert goals["auto-k4-m4: above the best fixed on the bursty trace"]["ratio"] == pytest.approx(70 / 60)
    psd_goal = goals["psd-k4-m4-adaptive: >= 1.8x sd at its best point"]
    assert analysis["per_point"]["bursty"]["psd-k4-m4-adaptive/sd-k4-m4"] == pytest.approx(90 / 60)
    assert psd_goal["point"] == "c4" and psd_goal["ratio"] == pytest.approx(150 / 80) and psd_goal["met"]
    assert report.points["sd-k4-m4"]["c4"]["outputs_equal_to_ar"]["num_equal"] == 0
    assert report.points["auto-k4-m4"]["c4"]["outputs_equal_to_ar"]["num_equal"] == 1
    assert compare_tokens([_result([1])], [_result([1])])["num_equal"] == 1
    assert "**met**" in open(tmp_path / "results.md").read() and os.path.getsize(tmp_path / "load_sweep.png") > 0


def test_cpu_twin_end_to_end(model_dirs, tmp_path):  # noqa: F811
    target, draft = model_dirs
    data = tmp_path / "question.jsonl"
    data.write_text("".join(json.dumps({"question_id": qid, "category": cat, "turns": [text]}) + "\n"
                            for qid, cat, text in PROMPTS))
    out = tmp_path / "out"
    argv = ["--out-dir", str(out), "--logs-dir", str(tmp_path / "logs"), "--device", "cpu", "--target", target,
            "--draft", draft, "--prompts", str(data), "--configs", CONFIGS, "--concurrencies", "1,3",
            "--min-requests", "3", "--max-requests", "3", "--max-tokens", "4", "--max-model-len", "256", "--num-bursts", "2",
            "--burst-size", "2,3", "--gap-s", "0.2,0.3", "--num-trickle", "1", "--num-warmup", "2",
            "--ignore-eos", "--time-budget-s", "600"]
    assert parse_args(argv).burst.num_bursts == 2
    assert main(argv) == 0
    payload = json.loads((out / "results.json").read_text())
    assert set(payload["points"]) == set(CONFIGS.split(","))
    for name, by_label in payload["points"].items():
        assert set(by_label) == {"c1", "c3", "bursty"}
        for label, m in by_label.items():
            assert m["num_output_tokens"] == 4 * m["num_requests"] and m["output_tokens_per_s"] > 0
            assert m["ttft_ms_p50"] <= m["latency_ms_p99"] and m["num_steps"] > 0
            assert 0 <= m["slow_step_s"] <= m["step_s"] and m["num_slow_steps"] <= m["num_steps"]
            if name != "ar-m2":
                assert m["outputs_equal_to_ar"]["num_equal"] == m["outputs_equal_to_ar"]["num_compared"] == m["num_requests"]
    auto = payload["points"]["auto-k3-m2-adaptive-feedback"]
    assert sum(sum(m["steps_by_mode"].values()) for m in auto.values()) > 0
    assert any(m["auto_decisions"] for m in auto.values())       # from the coordinator's /metrics
    assert set(payload["analysis"]["per_point"]) == {"c1", "c3", "bursty"}
    assert set(payload["analysis"]["goals"]) == {"auto-k3-m2-adaptive-feedback: within 3% of the best fixed at every "
                                                 "load point", "auto-k3-m2-adaptive-feedback: above the best fixed on "
                                                 "the bursty trace"}
    assert payload["config"]["points"]["bursty"]["num_requests"] == len(bursty_arrivals(parse_args(argv).burst, 0))
    assert "best fixed" in (out / "results.md").read_text() and os.path.getsize(out / "load_sweep.png") > 0


def test_report_rounds_median_and_paired_ratios(tmp_path):
    configs = tuple(parse_config(n) for n in ("ar-m4", "auto-k4-m4"))
    report = SweepReport(str(tmp_path), {"temperature": 0}, configs)
    rounds = {"ar-m4": (100, 140, 90), "auto-k4-m4": (99, 120, 95)}
    for index in range(3):
        for config in configs:
            tokens = [1, 2] if (config.name, index) != ("auto-k4-m4", 2) else [1, 3]
            report.add(config, "c4", {"output_tokens_per_s": rounds[config.name][index], "kind": "closed",
                                      "concurrency": 4, "round": index}, [_result(tokens)])
    auto = report.points["auto-k4-m4"]["c4"]
    assert auto["output_tokens_per_s"] == 99 and auto["round"] == 0 and auto["rounds_tps"] == [99, 120, 95]
    assert report.points["ar-m4"]["c4"]["output_tokens_per_s"] == 100 and auto["num_rounds"] == 3
    assert auto["outputs_equal_to_ar"] == {"num_compared": 3, "num_equal": 2, "differing": [0]}
    entry = report.analysis()["per_point"]["c4"]
    assert entry["auto-k4-m4/best_fixed"] == pytest.approx(0.99)
    assert entry["auto-k4-m4/best_fixed per round"] == pytest.approx([0.99, 120 / 140, 95 / 90])
    text = open(tmp_path / "results.md").read()
    assert "95.0-120.0 (3)" in text and "0.990 / 0.857 / 1.056" in text


def test_rounds_schedule_interleaves_configurations(tmp_path):
    from bench.load.load_sweep import schedule
    base = ["--out-dir", str(tmp_path), "--logs-dir", "L", "--configs", "ar-m2,sd-k2-m2"]
    assert [(c.name, d) for c, d in schedule(parse_args(base))] == [("ar-m2", "L/ar-m2"), ("sd-k2-m2", "L/sd-k2-m2")]
    plan = [(c.name, d) for c, d in schedule(parse_args(base + ["--rounds", "2"]))]
    assert plan == [("ar-m2", "L/ar-m2/round0"), ("sd-k2-m2", "L/sd-k2-m2/round0"),
                    ("ar-m2", "L/ar-m2/round1"), ("sd-k2-m2", "L/sd-k2-m2/round1")]
    with pytest.raises(SystemExit):
        parse_args(base + ["--rounds", "0"])
    assert parse_args(base).drafter_gpu == 1 and parse_args(base + ["--drafter-gpu", "0"]).drafter_gpu == 0
    with pytest.raises(SystemExit):
        parse_args(base + ["--drafter-gpu", "-1"])


def test_front_passes_the_configuration_budget_to_its_coordinator(tmp_path):
    from bench.load.load_sweep import Front, engine_config
    from coordinator.__main__ import parse_args as coordinator_args
    from minedraft.stack import coordinator_spec

    args = parse_args(["--out-dir", str(tmp_path), "--logs-dir", str(tmp_path), "--device", "cpu",
                       "--configs", "ar-m2-b8,ar-m2"])
    cfg = engine_config(args, args.configs)
    budgets = [coordinator_args(coordinator_spec(Front(cfg, sweep, ("/t", "d"), str(tmp_path), 1.0).cfg).argv[3:])
               .max_num_batched_tokens for sweep in args.configs]
    assert budgets == [8, 4096]   # the configuration's, else the stack's CPU default


def test_engines_get_the_sweeps_prefill_settings(tmp_path):
    from bench.load.load_sweep import engine_config
    from minedraft.stack import verifier_spec
    from verifier_svc.__main__ import parse_args as verifier_args

    base = ["--out-dir", str(tmp_path), "--logs-dir", str(tmp_path), "--device", "cpu", "--configs", "ar-m2"]
    for extra, expected in (([], (None, None)), (["--max-graph-prefill-tokens", "0"], (None, 0)),
                            (["--max-prefill-tokens", "8192"], (8192, None))):
        args = parse_args(base + extra)
        engine = verifier_args(verifier_spec(engine_config(args, args.configs), "/t").argv[3:])
        assert (engine.max_prefill_tokens, engine.max_graph_prefill_tokens) == expected
