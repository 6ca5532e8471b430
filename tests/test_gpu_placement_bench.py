"""bench/gpu/gpu_stack.py's CPU-side logic: replica placement, prompt split, report (ratios,
greedy output checks, BENCHMARK-ONLY labels). The GPU runs themselves need the lent machine."""
from __future__ import annotations

import json

from bench.gpu.gpu_stack import _replica_configs, engine_config, parse_args, split_prompts
from bench.gpu.gpu_stack_report import Report, RunResult, merge_runs
from minedraft.client import GenerationResult
from minedraft.placement import CUDA_ENV
from minedraft.prompts import summarize
from minedraft.stack import drafter_spec, verifier_spec
from minedraft.v1 import common_pb2


def _result(qid: str, index: int, tokens: list[int], latency_s: float, accepted: int = 0, drafts: int = 0):
    usage = common_pb2.Usage(completion_tokens=len(tokens), num_accepted_tokens=accepted, num_drafts=drafts,
                             num_draft_tokens=4 * drafts)
    return GenerationResult(request_id=f"q{qid}-{index}", token_ids=tokens, usage=usage,
                            ttft_s=latency_s / 4, latency_s=latency_s)


def _run(mode: str, outputs: dict[str, list[int]], wall_s: float) -> RunResult:
    results = [_result(q, i, t, 1.0, accepted=len(t) // 2, drafts=len(t) // 2) for i, (q, t) in enumerate(outputs.items())]
    return RunResult(mode, summarize(results, wall_s), results)


def test_replicas_one_per_gpu():
    args = parse_args(["--out-dir", "x", "--device", "cuda"])
    cfg = engine_config(args, "t", "d", 0, 1, None)
    r0, r1 = _replica_configs(cfg, "cuda")
    assert verifier_spec(r0, "t").env == {CUDA_ENV: "0"} and drafter_spec(r0, "t", "d").env == {CUDA_ENV: "0"}
    assert verifier_spec(r1, "t").env == {CUDA_ENV: "1"} and drafter_spec(r1, "t", "d").env == {CUDA_ENV: "1"}
    assert r0.verifier_port == cfg.verifier_port and r1.drafter_port == cfg.drafter_port   # reuse part a's
    assert r0.drafter_port != cfg.drafter_port and r1.verifier_port != cfg.verifier_port
    assert cfg.dtype == "bfloat16"


def test_split_prompts(tmp_path):
    src = tmp_path / "q.jsonl"
    src.write_text("".join(json.dumps({"question_id": i, "turns": ["x"]}) + "\n" for i in range(7)))
    halves = split_prompts(str(src), 5, str(tmp_path / "out"))
    ids = [[json.loads(line)["question_id"] for line in open(h)] for h in halves]
    assert ids == [[0, 2, 4], [1, 3]]


def test_report_ratios_equality_and_labels(tmp_path):
    cfg = vars(parse_args(["--out-dir", str(tmp_path), "--device", "cuda"])) | {"fixed_acceptance": 0.7}
    report = Report(str(tmp_path), cfg)
    same = {"1": [5, 6, 7, 8], "2": [9, 9]}
    report.add("a", _run("ar", same, 2.0))
    report.add("a", _run("sd", {"1": [5, 6, 7, 8], "2": [9, 1]}, 3.0))
    report.add("a", _run("psd", same, 1.0))
    halves = [[_result("1", 0, [5, 6, 7, 8], 1.0)], [_result("2", 0, [9, 9], 1.0)]]
    report.add("b", merge_runs("2x sd", halves, 1.5))
    report.add("c", _run("psd", same, 1.0))
    report.add("c", _run("sd", same, 2.0))
    payload = json.loads((tmp_path / "results.json").read_text())
    ratios = payload["ratios"]
    assert ratios["a"]["psd/ar"] == 2.0 and ratios["a"]["psd/sd"] == 3.0 and ratios["a"]["psd/2x sd"] == 1.5
    assert ratios["c"] == {"psd/sd": 2.0}
    equal = payload["parts"]["a"]["outputs_equal_to_ar"]
    assert equal["sd"]["num_equal"] == 1 and equal["sd"]["differing"] == ["q2"] and equal["psd"]["num_equal"] == 2
    assert payload["parts"]["b"]["outputs_equal_to_ar"]["2x sd"]["num_equal"] == 2
    assert payload["parts"]["a"]["benchmark_only"] is None
    assert payload["parts"]["c"]["benchmark_only"] == "BENCHMARK-ONLY fixed acceptance 0.7"
    assert payload["parts"]["c"]["outputs_equal_to_ar"] == {}          # fixed acceptance: no identity claim
    markdown = (tmp_path / "results.md").read_text()
    assert "part c" in markdown and "**BENCHMARK-ONLY fixed acceptance 0.7**" in markdown
    assert payload["paper_scale_expected_mean_acceptance_length"] == sum(0.7 ** i for i in range(5))


def test_summarize_step_log(tmp_path):
    from bench.gpu.gpu_stack_report import summarize_step_log

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps({"wall_ms": w, "draft_ms": d, "verify_ms": v, "data_plane_ms": 0.5,
                                        "idle_ms": w - v}) + "\n" for w, d, v in ((10, 4, 8), (20, 6, 12))))
    summary = summarize_step_log(str(path))
    assert summary["num_steps"] == 2 and summary["step_wall_ms_mean"] == 15 and summary["step_draft_ms_mean"] == 5
    assert summary["step_idle_ms_mean"] == 5 and summarize_step_log(str(tmp_path / "missing.jsonl")) == {}
