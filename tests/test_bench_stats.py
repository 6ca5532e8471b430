"""Unit tests of the benchmark suite's statistics, ratios, greedy check, prompt selection and config."""
from __future__ import annotations

import json
import math

import pytest

from bench.common.loadgen import RequestResult, load_spec_bench
from bench.common.report import compute_ratios, greedy_check, markdown, plot
from bench.common.stats import SpecCounts, critical_call_overhead, mean_acceptance_length, percentile, ratio, spec_counts_from_usage, step_split, \
    summarize, summarize_by_task
from bench.common.suite import SuiteConfig, plan
from bench.common.systems import SYSTEMS, vllm_spec_counters


def _result(pid="1", task="qa", tokens=10, ttft=5.0, latency=50.0, spec=None, error=""):
    return RequestResult(pid, task, text=f"t{pid}", num_output_tokens=tokens, ttft_ms=ttft, latency_ms=latency,
                         spec=spec, error=error)


def test_percentile_interpolates_and_ignores_nan():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0, float("nan"), 0.0], 100) == 10.0
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q"):
        percentile([1], 101)


def test_mean_acceptance_length_and_spec_counts():
    assert mean_acceptance_length(6, 4) == 2.5
    assert mean_acceptance_length(0, 0) == 1.0
    counts = spec_counts_from_usage([
        _result(spec={"num_draft_tokens": 8, "num_accepted_tokens": 3, "num_drafts": 2}),
        _result(spec={"num_draft_tokens": 4, "num_accepted_tokens": 1, "num_drafts": 1}),
        _result(spec={"num_draft_tokens": 99, "num_accepted_tokens": 99, "num_drafts": 99}, error="boom")])
    assert counts == SpecCounts(12, 4, 3)
    assert counts.acceptance_rate == pytest.approx(4 / 12) and counts.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert spec_counts_from_usage([_result()]) is None


def test_summarize_counts_only_successful_requests():
    results = [_result("1", tokens=10, latency=100), _result("2", tokens=30, latency=300),
               _result("3", tokens=99, error="ConnectError")]
    m = summarize(results, wall_s=2.0, num_cores=2, spec=SpecCounts(10, 5, 5))
    assert m["num_requests"] == 3 and m["num_errors"] == 1 and m["num_output_tokens"] == 40
    assert m["output_tokens_per_s"] == 20 and m["requests_per_s"] == 1 and m["output_tokens_per_s_per_core"] == 10
    assert m["latency_ms_p50"] == 200 and m["mean_acceptance_length"] == 2.0 and m["acceptance_rate"] == 0.5
    assert summarize(results, 1.0, 1, None)["mean_acceptance_length"] == 1.0
    with pytest.raises(ValueError):
        summarize(results, 0.0, 1, None)
    by_task = summarize_by_task([_result("1", "qa"), _result("2", "rag", tokens=4)])
    assert by_task["rag"]["num_output_tokens"] == 4 and math.isnan(by_task["qa"]["mean_acceptance_length"])


def test_summarize_tpot_and_inter_token_latency():
    a = RequestResult("1", "qa", num_output_tokens=5, ttft_ms=10.0, latency_ms=50.0, itl_ms=[10.0, 10.0, 20.0])
    b = RequestResult("2", "qa", num_output_tokens=3, ttft_ms=20.0, latency_ms=120.0, itl_ms=[50.0, 50.0])
    one = RequestResult("3", "qa", num_output_tokens=1, ttft_ms=5.0, latency_ms=5.0)
    m = summarize([a, b, one], wall_s=1.0, num_cores=1, spec=None)
    assert m["tpot_ms_p50"] == pytest.approx((10.0 + 50.0) / 2)    # 40 / 4 and 100 / 2; "one" has no TPOT
    assert m["itl_ms_p50"] == 20.0 and m["itl_ms_max"] == 50.0
    assert m["itl_ms_p99"] == pytest.approx(50.0)
    assert math.isnan(summarize([one], 1.0, 1, None)["itl_ms_max"])


def test_step_split_means_over_the_window(tmp_path):
    path = tmp_path / "steps.jsonl"
    steps = [{"start_s": t, "draft_ms": d, "verify_ms": 10.0, "data_plane_ms": 1.0, "idle_ms": 2.0, "wall_ms": 12.0,
              "is_parallel": p} for t, d, p in ((1.0, 99.0, False), (5.0, 4.0, True), (6.0, 6.0, False))]
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    split = step_split(str(path), 2.0, 10.0)  # the first step (warm-up) is outside the window
    assert split["num_steps"] == 2 and split["draft_ms"] == 5.0 and split["parallel_step_ratio"] == 0.5
    assert step_split(str(path), 20.0, 30.0) is None and step_split(str(tmp_path / "none"), 0, 1) is None


def test_critical_call_overhead_is_what_the_coordinator_adds_around_the_call_that_ended_last():
    # step at t = 10 s, 30 ms wall: a Verify call sent at +0.5 ms (12 ms rpc), a Draft call sent at
    # +1.5 ms (25 ms rpc, 22 ms compute) that ends last: lead 1.5, rpc extra 3, tail 30 - 1.5 - 25 = 3.5
    step = {"start_s": 10.0, "wall_ms": 30.0, "is_parallel": True, "phases": [
        {"engine": "verifier", "start_s": 10.0005, "rpc_ms": 12.0, "compute_ms": 10.0},
        {"engine": "drafter", "start_s": 10.0015, "rpc_ms": 25.0, "compute_ms": 22.0}]}
    parts = critical_call_overhead([step, {**step, "wall_ms": 32.0}, {**step, "phases": []}])
    assert parts["critical_lead_ms"] == pytest.approx(1.5) and parts["critical_rpc_extra_ms"] == pytest.approx(3.0)
    assert parts["critical_tail_ms"] == pytest.approx(4.5)   # mean of 3.5 and 5.5; the step without phases left out
    assert critical_call_overhead([{**step, "phases": []}]) == {}


def test_rpc_extra_splits_into_service_and_transport_when_every_critical_call_reports_its_service_time():
    # Draft call: 25 ms at the coordinator, 23.5 ms in the drafter's handler, 22 ms of compute
    step = {"start_s": 10.0, "wall_ms": 30.0, "is_parallel": True, "phases": [
        {"engine": "verifier", "start_s": 10.0005, "rpc_ms": 12.0, "compute_ms": 10.0, "service_ms": 11.0},
        {"engine": "drafter", "start_s": 10.0015, "rpc_ms": 25.0, "compute_ms": 22.0, "service_ms": 23.5}]}
    parts = critical_call_overhead([step])
    assert parts["critical_service_extra_ms"] == pytest.approx(1.5) and parts["critical_transport_ms"] == pytest.approx(1.5)
    assert parts["critical_rpc_extra_ms"] == pytest.approx(3.0)
    assert "critical_request_transport_ms" not in parts     # no send time / handler start
    old_service = {**step, "phases": [{**step["phases"][1], "service_ms": 0.0}]}   # a service that does not report it
    parts = critical_call_overhead([step, old_service])
    assert "critical_transport_ms" not in parts and parts["critical_rpc_extra_ms"] == pytest.approx(3.0)
    # the Draft RPC sent at +1.6 ms, its handler started at +2.1 ms: 0.5 ms there, 1.0 ms back
    draft = {**step["phases"][1], "sent_s": 10.0016, "service_start_s": 10.0021}
    timed = {**step, "phases": [step["phases"][0], draft]}
    parts = critical_call_overhead([timed])
    assert parts["critical_request_transport_ms"] == pytest.approx(0.5)
    assert parts["critical_response_transport_ms"] == pytest.approx(1.0)
    assert "critical_request_transport_ms" not in critical_call_overhead([timed, step])   # one call without them


def test_a_vllm_verifiers_compute_splits_per_engine_step_into_its_engine_core_and_the_worker():
    # a 32-step Verify call: 205 ms of compute, 198.4 ms of it in vLLM's engine core
    call = {"engine": "verifier", "start_s": 5.0002, "rpc_ms": 208.0, "compute_ms": 205.0, "core_ms": 198.4, "core_steps": 32}
    step = {"start_s": 5.0, "wall_ms": 209.0, "is_parallel": False, "phases": [call]}
    parts = critical_call_overhead([step], prefix="serial")
    assert parts["serial_core_per_step_ms"] == pytest.approx(6.2) and parts["serial_worker_per_step_ms"] == pytest.approx(0.20625)
    native = {**step, "phases": [{**call, "core_ms": 0.0, "core_steps": 0}]}   # the native engine reports none
    assert "serial_core_per_step_ms" not in critical_call_overhead([step, native], prefix="serial")


def test_step_split_reports_the_serial_steps_call_overhead_apart(tmp_path):
    """``ar``'s steps (one Verify call, not parallel) get ``serial_*``, psd's parallel ones ``critical_*``."""
    serial = {"start_s": 5.0, "draft_ms": 0.0, "verify_ms": 100.0, "data_plane_ms": 0.0, "idle_ms": 5.0, "wall_ms": 105.0,
              "is_parallel": False, "phases": [{"engine": "verifier", "start_s": 5.0002, "rpc_ms": 104.0, "compute_ms": 100.0}]}
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(serial) + "\n")
    split = step_split(str(path), 0.0, 10.0)
    assert split["serial_rpc_extra_ms"] == pytest.approx(4.0) and split["serial_lead_ms"] == pytest.approx(0.2)
    assert split["serial_tail_ms"] == pytest.approx(0.8) and "critical_rpc_extra_ms" not in split


def _run(system, k, tok_s, lat=100.0, temperature=0.0, m=4):
    family = SYSTEMS[system].family
    run_id = f"{system}-k{k}-m{m}-T{temperature:g}"
    return {"run_id": run_id, "system": system, "family": family, "mode": SYSTEMS[system].mode, "m": m, "k": k,
            "temperature": temperature, "metrics": {"output_tokens_per_s": tok_s, "latency_ms_p50": lat}}


def test_ratios_pair_systems_and_best_of_each_family():
    runs = [_run("ar", None, 10.0), _run("sd", 4, 8.0, 200.0), _run("psd", 4, 16.0, 50.0),
            _run("vllm-ar", None, 20.0), _run("vllm-sd", 4, 4.0)]
    by_name = {r["ratio"]: r for r in compute_ratios(runs)}
    assert by_name["psd/sd"]["output_tokens_per_s"] == 2.0 and by_name["psd/sd"]["latency_ms_p50"] == 0.25
    assert by_name["psd/ar"]["output_tokens_per_s"] == 1.6 and by_name["ar/vllm-ar"]["output_tokens_per_s"] == 0.5
    assert by_name["sd/vllm-sd"]["output_tokens_per_s"] == 2.0 and by_name["psd/vllm-sd"]["output_tokens_per_s"] == 4.0
    assert by_name["best-ours(psd k=4)/best-vllm(vllm-ar)"]["output_tokens_per_s"] == 0.8
    assert "psd/sd-2core" not in by_name
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(float("nan"), 1.0))


def test_greedy_check_compares_with_the_family_ar():
    runs = [_run("ar", None, 1), _run("psd", 4, 1), _run("vllm-ar", None, 1), _run("vllm-sd", 4, 1),
            _run("psd", 4, 1, temperature=1.0)]
    outputs = {"ar-kNone-m4-T0": {"1": "a", "2": "b"}, "psd-k4-m4-T0": {"1": "a", "2": "x"},
               "vllm-ar-kNone-m4-T0": {"1": "a", "2": "b"}, "vllm-sd-k4-m4-T0": {"1": "a", "2": "b"}}
    checks = {c["run_id"]: c for c in greedy_check(runs, outputs)}
    assert checks["psd-k4-m4-T0"]["mismatched_prompt_ids"] == ["2"] and checks["psd-k4-m4-T0"]["num_equal"] == 1
    assert checks["vllm-sd-k4-m4-T0"]["reference"] == "vllm-ar-kNone-m4-T0"
    assert checks["ar-kNone-m4-T0"]["reference"] == "vllm-ar-kNone-m4-T0" and len(checks) == 3
    meta = {"name": "x", "date_utc": "d", "git_commit": "c", "machine": "m", "command": "cmd", "workload": "w",
            "notes": ["n"]}
    for run in runs:
        run["metrics"].update({k: 1.0 for k in ("requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "latency_ms_p99",
                                                "mean_acceptance_length", "num_cores", "output_tokens_per_s_per_core",
                                                "num_errors")})
    runs[1]["by_task"] = {"qa": {"mean_acceptance_length": 1.5, "latency_ms_p50": 12.0}}
    text = markdown(meta, runs, compute_ratios(runs), list(checks.values()))
    assert "## temperature 1.0, m = 4" in text and "| psd-k4-m4-T0 | ar-kNone-m4-T0 | 1 / 2 | 2 |" in text
    assert "| run | qa |" in text and "| psd-k4-m4-T0 | 1.50 / 12 |" in text and "| ar-kNone-m4-T0 | - / - |" in text


def test_vllm_spec_counters_sum_label_sets():
    page = ("# HELP vllm:spec_decode_num_drafts_total x\n"
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 7.0\n')
    assert vllm_spec_counters(page) == {"num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 12.0}
    assert vllm_spec_counters(None) == {}


def test_load_spec_bench_round_robin_over_tasks(tmp_path):
    rows = [("1", "writing"), ("2", "coding"), ("3", "qa"), ("4", "qa"), ("5", "rag")]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [f"p{q}"]}) + "\n" for q, c in rows))
    prompts = load_spec_bench(str(path), 4, ("mt_bench", "qa"))
    assert [(p.prompt_id, p.task) for p in prompts] == [("1", "mt_bench"), ("3", "qa"), ("2", "mt_bench"), ("4", "qa")]
    with pytest.raises(ValueError, match="num_prompts"):
        load_spec_bench(str(path), 5, ("mt_bench", "qa"))
    with pytest.raises(ValueError, match="tasks"):
        load_spec_bench(str(path), 1, ("nope",))


def test_suite_config_validation_and_plan(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text("{}\n")
    cfg = SuiteConfig(data=str(data), systems=("ar", "psd", "vllm-sd"), ms=(4, 8), ks=(2, 4))
    assert plan(cfg) == [("ar", 4, None), ("ar", 8, None), ("psd", 4, 2), ("psd", 4, 4), ("psd", 8, 2),
                         ("psd", 8, 4), ("vllm-sd", 4, 2), ("vllm-sd", 4, 4), ("vllm-sd", 8, 2), ("vllm-sd", 8, 4)]
    assert cfg.has_vllm and not SuiteConfig(data=str(data)).has_vllm
    for field, value in (("systems", ("nope",)), ("ks", (0,)), ("temperatures", (-1.0,)), ("data", "/none")):
        with pytest.raises(ValueError, match=field):
            SuiteConfig(**{"data": str(data), field: value})
    assert SYSTEMS["psd"].max_num_seqs(4) == 4 and SYSTEMS["sd"].max_num_seqs(4) == 8
    assert SYSTEMS["vllm-ar"].max_num_seqs(4) == 8 and SYSTEMS["sd-2core"].num_engine_threads == 2
    assert SYSTEMS["ar"].num_cores(2, 1) == 1 and SYSTEMS["psd"].num_cores(2, 1) == 2
    assert SYSTEMS["vllm-sd"].num_cores(2, 1) == 1 and SYSTEMS["vllm-sd"].num_cores(2, 0) == 2


def test_plots_include_a_k_sweep_for_several_k(tmp_path):
    runs = [_run("ar", None, 10.0), _run("psd", 2, 12.0), _run("psd", 4, 14.0)]
    for run in runs:
        run["metrics"].update({"latency_ms_p99": 2.0, "ttft_ms_p50": 1.0, "ttft_ms_p99": 1.5})
    runs[1]["step_split"] = {"draft_ms": 3.0, "verify_ms": 5.0, "data_plane_ms": 0.1, "idle_ms": 0.5}
    paths = plot(runs, str(tmp_path), "(test)")
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["k_sweep.png", "latency.png", "step_split.png",
                                                          "throughput.png", "ttft.png"]
    assert all((tmp_path / p.rsplit("/", 1)[1]).stat().st_size > 1000 for p in paths)


def test_export_draft_is_a_standalone_hf_model_equal_to_our_draft(tiny_llama_dir, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from bench.engines.export_hf import EXPORT_META_FILE, export_draft, export_target
    from specdec.models.draft_format import load_draft, make_truncated_draft

    target = tiny_llama_dir(tmp_path / "target", num_layers=3)
    make_truncated_draft(target, [0, 2], str(tmp_path / "draft"))
    meta = export_draft(str(tmp_path / "draft"), target, str(tmp_path / "out" / "draft"))
    assert meta["num_layers"] == 2 and meta["exported_vocab_size"] == 128
    assert json.loads((tmp_path / "out" / "draft" / EXPORT_META_FILE).read_text())["note"].startswith("vLLM's draft")
    exported = LlamaForCausalLM.from_pretrained(str(tmp_path / "out" / "draft")).eval()
    ours = load_draft(str(tmp_path / "draft"), target_dir=target)
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ours(ids).logits)
    export_target(target, str(tmp_path / "out" / "target"))
    assert (tmp_path / "out" / "target" / "model.safetensors").stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="target_dir"):
        export_target(str(tmp_path / "draft" / ".."), str(tmp_path / "bad"))
