"""The benchmark suite end to end on tiny models: our ar and psd through the HTTP API (real processes)."""
from __future__ import annotations

import json
import os

import pytest

from bench.common.suite import SuiteConfig, run_suite
from test_e2e_stack import model_dirs  # noqa: F401  (module fixture: tiny target + draft with the SmolLM2 tokenizer)

PROMPTS = [("1", "writing", "Write a haiku about the sea."), ("2", "translation", "Translate to French: good morning"),
           ("3", "qa", "What is the capital of Italy?"), ("4", "roleplay", "Pretend you are a pirate. Say hello.")]


@pytest.fixture(scope="module")
def suite_results(model_dirs, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("suite")
    data = root / "question.jsonl"
    data.write_text("".join(json.dumps({"question_id": qid, "category": cat, "turns": [text]}) + "\n"
                            for qid, cat, text in PROMPTS))
    target, draft = model_dirs
    cfg = SuiteConfig(name="tiny", out_dir=str(root / "out"), data=str(data), num_prompts=4,
                      tasks=("mt_bench", "translation", "qa"), max_tokens=8, temperatures=(0.0,), ms=(2,), ks=(3,),
                      systems=("ar", "psd"), target=target, draft=draft, max_model_len=256, ignore_eos=True,
                      num_warmup=1, startup_timeout_s=300)
    return cfg, run_suite(cfg, "pytest tests/test_bench_suite.py")


def test_writes_json_markdown_and_plots(suite_results):
    cfg, results = suite_results
    for name in ("results.json", "results.md", "throughput.png", "latency.png", "ttft.png", "step_split.png",
                 "outputs/ar-m2-T0.json", "outputs/psd-k3-m2-T0.json"):
        assert os.path.getsize(os.path.join(cfg.out_dir, name)) > 0, name
    with open(os.path.join(cfg.out_dir, "results.json")) as f:
        on_disk = json.load(f)
    assert on_disk["meta"]["command"] == "pytest tests/test_bench_suite.py"
    assert on_disk["meta"]["git_commit"] and on_disk["meta"]["machine"] and on_disk["meta"]["date_utc"]
    text = open(os.path.join(cfg.out_dir, "results.md")).read()
    assert "| psd | 3 |" in text and "| ar | - |" in text and "psd/ar" in text


def test_numbers_are_positive_and_complete(suite_results):
    _, results = suite_results
    assert not results["failures"]
    assert [r["system"] for r in results["runs"]] == ["ar", "psd"]
    for run in results["runs"]:
        m = run["metrics"]
        assert m["num_requests"] == 4 and m["num_errors"] == 0
        assert m["num_output_tokens"] == 4 * 8  # ignore_eos: exactly max_tokens each
        for key in ("output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "latency_ms_p50",
                    "latency_ms_p99", "output_tokens_per_s_per_core"):
            assert m[key] > 0, key
        assert m["ttft_ms_p50"] <= m["latency_ms_p50"]
        assert 0 < m["itl_ms_p50"] <= m["itl_ms_max"] < m["latency_ms_p99"] and m["tpot_ms_p50"] > 0
        assert run["step_split"]["num_steps"] > 0 and run["step_split"]["verify_ms"] > 0
    ar, psd = results["runs"]
    assert ar["metrics"]["mean_acceptance_length"] == 1.0 and ar["max_num_seqs"] == 4
    assert psd["metrics"]["mean_acceptance_length"] >= 1.0 and psd["max_num_seqs"] == 2
    assert 0 <= psd["metrics"]["acceptance_rate"] <= 1  # read from the usage extension (NaN when missing)
    assert psd["step_split"]["draft_ms"] > 0 and ar["step_split"]["draft_ms"] == 0
    assert {r["ratio"] for r in results["ratios"]} == {"psd/ar"}


def test_psd_greedy_outputs_equal_ar(suite_results):
    _, results = suite_results
    (check,) = results["greedy_check"]
    assert check["run_id"] == "psd-k3-m2-T0" and check["reference"] == "ar-m2-T0"
    assert check["num_compared"] == 4 and check["num_equal"] == 4, check["mismatched_prompt_ids"]
