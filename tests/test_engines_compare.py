"""bench.engines.engines_compare: system names, vLLM server command lines, ratios, greedy checks, the
Markdown table (hand-built records), and one tiny run of vLLM's own server against psd on vLLM.

The tiny run starts ``vllm-ar`` (vLLM's OpenAI server from ``.venv-vllm``) and ``psd-vllm`` (our
stack with ``--engine vllm``) on CPU: about a minute. Without ``.venv-vllm`` it fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.engines.compare_systems import SystemName, parse_system, synthetic_rates, vllm_server_argv
from bench.engines.engines_compare import CompareConfig
from bench.engines.report_compare import greedy_vs_reference, markdown, ratios_by_concurrency, repeats_a_stretch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)


@pytest.mark.parametrize("name, expected", [
    ("vllm-ar", SystemName("vllm", "ar")),
    ("vllm-sd-k4", SystemName("vllm", "sd", k=4)),
    ("vllm-sd-k12", SystemName("vllm", "sd", k=12)),
    ("psd-vllm", SystemName("ours", "psd", "vllm")),
    ("ar-native", SystemName("ours", "ar", "native")),
    ("auto-vllm", SystemName("ours", "auto", "vllm", adaptive_k=True)),
    ("psd-vllm-adaptive", SystemName("ours", "psd", "vllm", adaptive_k=True)),
    ("psd-vllm-vsm70", SystemName("ours", "psd", "vllm", verifier_sm_percent=70)),
    ("psd-vllm-adaptive-ses-vsm70", SystemName("ours", "psd", "vllm", adaptive_k=True, draft_sessions=True,
                                               verifier_sm_percent=70)),
    ("sd-vllm-ds1-adaptive-vsm100", SystemName("ours", "sd", "vllm", decode_steps=1, adaptive_k=True)),
    ("ar-vllm-ds16", SystemName("ours", "ar", "vllm", decode_steps=16)),
    ("psd-native-ds1", SystemName("ours", "psd", "native", decode_steps=1)),
    ("ar-vllm-ds32-block", SystemName("ours", "ar", "vllm", decode_steps=32, stream_decode_steps=False)),
    ("ar-vllm-ds32-si4", SystemName("ours", "ar", "vllm", decode_steps=32, stream_interval=4)),
    ("ar-native-si1", SystemName("ours", "ar", "native", stream_interval=1)),
    ("ar-vllm-ms0", SystemName("ours", "ar", "vllm", stream_interval_ms=0)),
    ("psd-vllm-prop", SystemName("ours", "psd", "vllm", draft_proposer=True)),
    ("sd-vllm-adaptive-prop-vsm70", SystemName("ours", "sd", "vllm", adaptive_k=True, draft_proposer=True,
                                               verifier_sm_percent=70)),
    ("ar-vllm-ds32-si4-ms20-adaptive", SystemName("ours", "ar", "vllm", decode_steps=32, stream_interval=4,
                                                  stream_interval_ms=20, adaptive_k=True)),
    ("vllm-ar-v1", SystemName("vllm", "ar", model_runner_v1=True)),
    ("vllm-sd-k3-v1", SystemName("vllm", "sd", k=3, model_runner_v1=True)),
    ("ar-vllm-ds64-v1", SystemName("ours", "ar", "vllm", decode_steps=64, model_runner_v1=True)),
    ("psd-vllm-ses-vsm70-v1", SystemName("ours", "psd", "vllm", draft_sessions=True, verifier_sm_percent=70,
                                         model_runner_v1=True)),
    ("psd-vllm-ses-dp2", SystemName("ours", "psd", "vllm", draft_sessions=True, draft_processes=2)),
    ("psd-vllm-adaptive-ses-dp4-vsm70", SystemName("ours", "psd", "vllm", adaptive_k=True, draft_sessions=True,
                                                   draft_processes=4, verifier_sm_percent=70)),
])
def test_parse_system_reads_every_form(name, expected):
    assert parse_system(name) == expected


@pytest.mark.parametrize("name", ["vllm-sd-k0", "vllm-sd", "vllm-sd-kx", "vllm-psd", "psd", "psd-tgi", "xyz-vllm", "",
                                  "ar-vllm-ds0", "ar-vllm-ds65", "vllm-ar-ds8", "ar-vllm-dsx", "ar-vllm-si0",
                                  "ar-vllm-si65", "ar-vllm-si4-block", "ar-vllm-block-ds8", "ar-vllm-si4-ds8",
                                  "psd-vllm-vsm0", "psd-vllm-vsm101", "psd-vllm-vsm70-adaptive", "vllm-sd-k3-adaptive",
                                  "psd-vllm-ses-adaptive", "vllm-ar-ses", "ar-vllm-ms60001", "ar-vllm-ms20-si4",
                                  "ar-vllm-msx", "psd-vllm-ses-prop", "psd-vllm-prop-ses", "psd-vllm-prop-adaptive",
                                  "vllm-v1", "vllm-ar-v2", "vllm-v1-ar", "ar-vllm-v1-ds8", "vllm-sd-k3-v1-v1",
                                  "psd-vllm-dp0", "psd-vllm-dp65", "psd-vllm-dp2-ses", "vllm-sd-k3-dp2"])
def test_parse_system_refuses_unknown_names_naming_them(name):
    with pytest.raises(ValueError, match=f"unknown system '{name}'"):
        parse_system(name)
    with pytest.raises(ValueError):
        CompareConfig(out_dir="x", systems=("vllm-ar", name))


@pytest.mark.parametrize("name", ["psd-vllm", "psd-vllm-adaptive", "auto-vllm", "sd-native-ds8-vsm60", "sd-vllm-ses",
                                  "psd-vllm-prop", "psd-vllm-ses-dp2"])
def test_our_stack_config_carries_the_k_policy_and_the_verifier_sm_share(name, tmp_path):
    from bench.engines.compare_systems import our_stack_config
    from minedraft.placement import MPS_SM_ENV
    from minedraft.stack import drafter_spec, verifier_spec

    system = parse_system(name)
    cfg = CompareConfig(out_dir="x", systems=(name,), cuda_mps=True, m=4, k=3)
    stack = our_stack_config(system, cfg, str(tmp_path), str(tmp_path / "steps.jsonl"))
    assert stack.k_policy == ("adaptive" if name.startswith("auto") or "adaptive" in name else "fixed")
    assert stack.balancer == ("feedback" if name.startswith("auto") else "paper")
    assert (stack.mode, stack.engine, stack.num_speculative_tokens) == (system.mode, system.engine, 3)
    assert stack.max_num_seqs == (4 if system.mode in ("psd", "auto") else 8)
    assert verifier_spec(stack, "/m").env.get(MPS_SM_ENV) == ("60" if "vsm60" in name else None)
    assert stack.draft_sessions == ("-ses" in name)
    assert stack.draft_proposer == name.endswith("-prop")
    assert stack.draft_processes == (2 if name.endswith("-dp2") else 1)
    assert (["--draft-processes", "2"] == drafter_spec(stack, "/m", "/d").argv[-2:]) == name.endswith("-dp2")
    if "vsm" in name:
        with pytest.raises(ValueError, match="needs --cuda-mps"):
            CompareConfig(out_dir="x", systems=(name,))


@pytest.mark.parametrize("name, interval_ms", [("ar-vllm", 50), ("ar-vllm-ms0", 0), ("ar-vllm-si4-ms20", 20)])
def test_our_stack_config_carries_the_stream_interval_ms(name, interval_ms, tmp_path):
    from bench.engines.compare_systems import our_stack_config

    stack = our_stack_config(parse_system(name), CompareConfig(out_dir="x", systems=(name,)), str(tmp_path),
                             str(tmp_path / "steps.jsonl"))
    assert stack.stream_interval_ms == interval_ms


def test_synthetic_rates_are_the_powers_of_p():
    assert synthetic_rates(0.5, 3) == [0.5, 0.25, 0.125]
    assert synthetic_rates(0.7, 1) == [0.7]
    assert synthetic_rates(1.0, 4) == [1.0] * 4


def _argv(system: str, **cfg) -> list[str]:
    config = CompareConfig(out_dir="x", m=3, max_model_len=512, dtype="float32", **cfg)
    return vllm_server_argv("/py", config, parse_system(system), 8123, ("/t", "dummy"), ("/d", "auto"))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_ar_server_argv_has_no_speculation(device):
    argv = _argv("vllm-ar", device=device, enforce_eager=device == "cpu")
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/t" and _flag(argv, "--load-format") == "dummy"
    assert _flag(argv, "--max-num-seqs") == "6" and _flag(argv, "--max-model-len") == "512"   # 2m
    assert _flag(argv, "--port") == "8123" and _flag(argv, "--dtype") == "float32"
    assert "--speculative-config" not in argv
    assert ("--gpu-memory-utilization" in argv) == (device == "cuda")
    assert ("--enforce-eager" in argv) == (device == "cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_sd_server_argv_drafts_k_tokens_with_the_draft_model(device):
    spec = json.loads(_flag(_argv("vllm-sd-k5", device=device), "--speculative-config"))
    assert spec == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 5}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_sd_server_argv_with_fixed_acceptance_uses_synthetic_rates(device):
    argv = _argv("vllm-sd-k3", device=device, fixed_acceptance=0.5)
    spec = json.loads(_flag(argv, "--speculative-config"))
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 3
    assert spec["rejection_sample_method"] == "synthetic"
    assert spec["synthetic_acceptance_rates"] == [0.5, 0.25, 0.125]
    assert "synthetic" not in json.dumps(_argv("vllm-ar", device=device, fixed_acceptance=0.5))


def _record(system: str, c: int, tok_s: float, outputs: dict | None = None) -> dict:
    record = {"system": system, "concurrency": c, "errors": [], "step_split": None,
              "metrics": {"output_tokens_per_s": tok_s, "ttft_ms_p50": 10.0, "latency_ms_p50": 100.0,
                          "mean_acceptance_length": 2.5, "num_errors": 1 if system == "vllm-ar" else 0}}
    return {**record, "outputs": outputs} if outputs is not None else record


RECORDS = [
    _record("vllm-ar", 1, 100.0), _record("vllm-sd-k4", 1, 150.0), _record("psd-vllm", 1, 180.0),
    _record("ar-vllm", 1, 90.0),
    _record("vllm-ar", 4, 200.0), _record("psd-vllm", 4, 300.0), {"system": "sd-vllm", "concurrency": 4,
                                                                  "skipped": "time budget"},
    _record("psd-vllm", 8, 400.0),   # no vLLM run at c=8: no ratio row
]


def test_ratios_per_concurrency_against_vllm_ar_and_the_best_vllm_system():
    rows = {row["concurrency"]: row for row in ratios_by_concurrency(RECORDS)}
    assert sorted(rows) == [1, 4]
    one = rows[1]
    assert (one["best_vllm"], one["best_ours"], one["best_vllm_sd"]) == ("vllm-sd-k4", "psd-vllm", "vllm-sd-k4")
    assert one["best_ours_over_best_vllm"] == pytest.approx(1.2)
    assert one["over_vllm_ar"] == pytest.approx({"psd-vllm": 1.8, "ar-vllm": 0.9})
    assert one["over_best_vllm"] == pytest.approx({"psd-vllm": 1.2, "ar-vllm": 0.6})
    assert one["psd_over_best_vllm_sd"] == pytest.approx({"psd-vllm": 1.2})
    four = rows[4]
    assert four["best_vllm"] == "vllm-ar" and four["over_vllm_ar"] == pytest.approx({"psd-vllm": 1.5})
    assert "best_vllm_sd" not in four and "psd_over_best_vllm_sd" not in four


def test_ratios_without_vllm_ar_leave_its_column_empty():
    rows = ratios_by_concurrency([_record("vllm-sd-k2", 1, 50.0), _record("psd-vllm", 1, 75.0)])
    assert rows[0]["over_vllm_ar"] == {} and rows[0]["psd_over_best_vllm_sd"] == pytest.approx({"psd-vllm": 1.5})


def test_greedy_comparison_counts_equal_outputs_on_common_prompts_at_the_same_concurrency():
    records = [_record("vllm-ar", 1, 1.0, {"1": "a", "2": "b"}), _record("psd-vllm", 1, 1.0, {"1": "a", "2": "x", "3": "c"}),
               _record("sd-vllm", 1, 1.0, {"1": "a", "2": "b"}), _record("psd-vllm", 4, 1.0, {"1": "a"}),
               _record("ar-vllm", 1, 1.0)]
    assert greedy_vs_reference(records) == [
        {"system": "psd-vllm", "concurrency": 1, "num_equal": 1, "num_compared": 2, "num_repeats": 0},
        {"system": "sd-vllm", "concurrency": 1, "num_equal": 2, "num_compared": 2, "num_repeats": 0}]


def test_a_mismatch_that_streams_a_stretch_twice_is_told_from_a_substitution():
    ref = "In a world where technology has transformed the way we live"
    assert repeats_a_stretch(ref, "In a world a world where technology has transformed the way")   # tokens sent twice
    assert repeats_a_stretch(ref, "In aa world where technology has transformed the way we")
    assert repeats_a_stretch(ref, "In a a world where technology has transformed the way we")
    # one digit again: a substituted token explains it as well (H200, session 26); two or more count
    math = "she can upload 210 * 10 = 210 photos in one day."
    assert not repeats_a_stretch(math, "she can upload 210 * 10 = 2100 photos in one day.")
    assert repeats_a_stretch(math, "she can upload 210 * 10 = 21010 photos in one day.")
    assert repeats_a_stretch("In 2024 we sold", "In 202424 we sold") and repeats_a_stretch("left. Then", "left.. Then")
    assert not repeats_a_stretch(ref, "In a world where science has transformed the way we live")    # numerics
    assert not repeats_a_stretch(ref, ref) and not repeats_a_stretch(ref, "In a world a world where people")
    looping = "Ten are male. Ten are male. Ten are male.\nSo the answer"   # the model loops by itself:
    assert not repeats_a_stretch(looping, "Ten are male. Ten are male. Ten are male. Ten are male.\nSo the answer")
    records = [_record("vllm-ar", 1, 1.0, {"1": ref, "2": ref}),
               _record("ar-vllm", 1, 1.0, {"1": "In a world a world where technology has transformed the way we",
                                           "2": "In a world where science has transformed the way we live"})]
    check = greedy_vs_reference(records)[0]
    assert (check["num_equal"], check["num_repeats"]) == (0, 1)


def _results(failures=()) -> dict:
    records = [r for r in RECORDS if r["concurrency"] == 1]
    return {"meta": {"date_utc": "2026-01-01T00:00:00+00:00", "machine": "cpu x2", "git_commit": "0123456789abcdef",
                     "command": "python -m bench.engines.engines_compare --x"},
            "runs": records + [{"system": "sd-vllm", "concurrency": 4, "skipped": "time budget"}],
            "ratios": ratios_by_concurrency(records),
            "greedy_vs_vllm_ar": [{"system": "psd-vllm", "concurrency": 1, "num_equal": 3, "num_compared": 4}],
            "failures": list(failures)}


def test_markdown_has_a_row_per_system_the_ratios_and_the_greedy_check():
    text = markdown(_results(), CompareConfig(out_dir="x", k=3, m=2, max_tokens=64))
    assert text.startswith("# Engines compare (2026-01-01T00:00:00+00:00, cpu x2, commit 0123456789)")
    for system, tok_s in (("vllm-ar", "100.0"), ("vllm-sd-k4", "150.0"), ("psd-vllm", "180.0"), ("ar-vllm", "90.0")):
        assert f"| {system} | {tok_s} |" in text
    assert "| sd-vllm |" not in text                                      # skipped: no row
    assert "| 1 | psd-vllm / vllm-sd-k4 = 1.20x | psd-vllm 1.80x, ar-vllm 0.90x | psd-vllm 1.20x (vllm-sd-k4) |" in text
    assert "- psd-vllm c=1: 3/4" in text and "k = 3 (ours), m = 2" in text
    assert "BENCHMARK-ONLY" not in text and "FAILED" not in text
    assert "| vllm-ar | 1 | 10 | 100 | - | - / - | 2.50 | - | - | - | - | - | - | 1 |" in text   # failed requests, not error kinds


def test_around_the_call_prefers_psds_parallel_steps_then_the_others():
    from bench.engines.report_compare import around_the_call

    serial = {"serial_lead_ms": 0.5, "serial_rpc_extra_ms": 3.0, "serial_tail_ms": 1.0}
    assert around_the_call(serial) == pytest.approx(4.5)
    assert around_the_call({**serial, "critical_lead_ms": 1.0, "critical_rpc_extra_ms": 2.0,
                            "critical_tail_ms": 2.0}) == pytest.approx(5.0)
    assert around_the_call({"draft_ms": 1.0}) is None


def test_rpc_extra_split_shows_service_and_transport_of_the_same_steps_as_around_the_call():
    from bench.engines.report_compare import rpc_extra_split

    serial = {"serial_lead_ms": 0.5, "serial_rpc_extra_ms": 3.0, "serial_tail_ms": 1.0}
    assert rpc_extra_split(serial) == "-" and rpc_extra_split({}) == "-"   # services without service_ms
    split = {**serial, "serial_service_extra_ms": 0.75, "serial_transport_ms": 2.25}
    assert rpc_extra_split(split) == "0.75 / 2.25"
    assert rpc_extra_split({**split, "serial_request_transport_ms": 1.0,
                            "serial_response_transport_ms": 1.25}) == "0.75 / 2.25 (1.00 + 1.25)"
    assert rpc_extra_split({**split, "critical_rpc_extra_ms": 2.0, "critical_service_extra_ms": 0.5,
                            "critical_transport_ms": 1.5}) == "0.50 / 1.50"


def test_per_engine_step_shows_the_verifiers_engine_core_and_worker_ms():
    from bench.engines.report_compare import per_engine_step

    assert per_engine_step({"serial_lead_ms": 0.5}) == "-"   # the native engine, vLLM's own server
    assert per_engine_step({"serial_core_per_step_ms": 6.2, "serial_worker_per_step_ms": 0.21}) == "6.20 + 0.21"
    assert per_engine_step({"critical_core_per_step_ms": 3.0, "critical_worker_per_step_ms": 0.5,
                            "serial_core_per_step_ms": 6.2, "serial_worker_per_step_ms": 0.21}) == "3.00 + 0.50"


def test_markdown_labels_fixed_acceptance_and_lists_failures():
    cfg = CompareConfig(out_dir="x", fixed_acceptance=0.7)
    text = markdown(_results([{"system": "vllm-sd-k4", "error": "RuntimeError: boom"}]), cfg)
    assert "**BENCHMARK-ONLY fixed acceptance 0.7** (not the target distribution)" in text
    assert "**FAILED** vllm-sd-k4: `RuntimeError: boom`" in text
    assert "psd-vllm c=1: 3/4" not in text   # speculative outputs follow the fixed acceptance: not compared


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """(target, draft): head_dim-64 tiny Llamas (the draft a different seed) with the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    from conftest import _build_tiny_llama
    from specdec.models.gguf import packaged_gguf_path

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                              gguf_file=os.path.basename(packaged_gguf_path()))
    dirs = []
    for name, seed, num_layers in (("target", 0, 2), ("draft", 1, 1)):
        path = str(tmp_path_factory.mktemp(name))
        _build_tiny_llama(num_layers=num_layers, vocab_size=49152, seed=seed, max_position_embeddings=256,
                          **SHAPE).save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return tuple(dirs)


def test_tiny_cpu_run_of_vllm_ar_and_psd_vllm_writes_both_and_equal_greedy_outputs(tiny_dirs, tmp_path):
    data = tmp_path / "question.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in (
        {"question_id": 1, "category": "writing", "turns": ["Hi"]},
        {"question_id": 2, "category": "translation", "turns": ["Translate: bonjour"]})) + "\n")
    out = tmp_path / "out"
    argv = ["--out-dir", str(out), "--device", "cpu", "--dtype", "float32", "--target", tiny_dirs[0],
            "--draft", tiny_dirs[1], "--systems", "vllm-ar,psd-vllm", "--concurrencies", "1", "--max-tokens", "8",
            "--m", "1", "--k", "2", "--max-model-len", "256", "--num-warmup", "1", "--enforce-eager",
            "--requests-per-client", "1", "--min-requests", "1", "--data", str(data)]
    proc = subprocess.run([sys.executable, "-m", "bench.engines.engines_compare", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["failures"] == []
    runs = {r["system"]: r for r in results["runs"]}
    assert sorted(runs) == ["psd-vllm", "vllm-ar"]
    for run in runs.values():
        assert run["concurrency"] == 1 and run["errors"] == []
        assert run["metrics"]["num_output_tokens"] == 8 and run["metrics"]["output_tokens_per_s"] > 0
    assert runs["psd-vllm"]["step_split"]["verify_ms"] > 0
    assert results["greedy_vs_vllm_ar"] == [{"system": "psd-vllm", "concurrency": 1, "num_equal": 1, "num_compared": 1,
                                             "num_repeats": 0}]
    outputs = json.loads((out / "outputs.json").read_text())
    assert outputs["vllm-ar-c1"]["1"] and outputs["vllm-ar-c1"] == outputs["psd-vllm-c1"]   # same non-empty text
    assert "| psd-vllm | 1 |" in (out / "results.md").read_text()


def test_only_v1_systems_start_their_engines_on_vllms_v1_model_runner():
    assert parse_system("vllm-ar-v1").engine_env == parse_system("psd-vllm-v1").engine_env == {
        "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert parse_system("vllm-ar").engine_env == parse_system("psd-vllm").engine_env == {}


def test_a_v1_system_of_ours_starts_its_services_with_the_v1_switch_and_leaves_the_environment_as_it_was(
        monkeypatch, tmp_path):
    from bench.common.systems import OursSystem
    from bench.engines.compare_systems import OursServer

    seen = {}
    monkeypatch.setattr(OursSystem, "__enter__", lambda self: seen.update(
        value=os.environ.get("VLLM_USE_V2_MODEL_RUNNER")) or "endpoint")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    server = OursServer.__new__(OursServer)
    server._engine_env = parse_system("ar-vllm-v1").engine_env
    assert server.__enter__() == "endpoint" and seen["value"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    server.__enter__()
    assert seen["value"] == "0" and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
