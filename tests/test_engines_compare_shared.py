"""engines_compare's shared engines (``bench.engines.shared_engines``): ours sd / psd / auto with the
same engine flags start their verifier and drafter once, each behind its own coordinator and gateway.

The last test runs three systems on the native engine with tiny random models on CPU (about a
minute): one engine start, three fronts, the same greedy outputs as ``ar``'s own stack.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.engines.engines_compare import CompareConfig
from bench.engines.report_compare import shared_engines
from bench.engines.shared_engines import SharedEngines, engine_key, group_systems
from bench.engines.compare_systems import parse_system
from test_engines_compare import ROOT, tiny_dirs  # noqa: F401  (the tiny target and draft)


def test_speculative_systems_with_the_same_engine_flags_share_a_start_in_order_of_first_appearance():
    names = ("vllm-ar", "psd-vllm-ses", "ar-vllm", "sd-vllm-ses", "psd-vllm", "auto-vllm-ses", "vllm-sd-k3",
             "psd-vllm-adaptive-ses", "sd-native", "psd-native-ds1", "psd-vllm-ses-dp2", "psd-vllm-ses-v1")
    assert group_systems(names) == [
        ("vllm-ar",), ("psd-vllm-ses", "sd-vllm-ses", "auto-vllm-ses", "psd-vllm-adaptive-ses"), ("ar-vllm",),
        ("psd-vllm",), ("vllm-sd-k3",), ("sd-native", "psd-native-ds1"), ("psd-vllm-ses-dp2",), ("psd-vllm-ses-v1",)]


@pytest.mark.parametrize("name", ["vllm-ar", "vllm-sd-k3", "ar-vllm", "ar-native"])
def test_vllms_servers_and_ours_ar_run_on_engines_of_their_own(name):
    # ours ar: a plain-decoding verifier (num_speculative_tokens 0), not the speculative one
    assert engine_key(parse_system(name)) is None
    assert group_systems((name, "ar-vllm-ds64" if name != "ar-vllm" else "ar-vllm-ds16")) == [
        (name,), ("ar-vllm-ds64" if name != "ar-vllm" else "ar-vllm-ds16",)]


def test_a_system_named_twice_or_unknown_is_refused_naming_it():
    with pytest.raises(ValueError, match="each system once"):
        group_systems(("psd-vllm", "psd-vllm"))
    with pytest.raises(ValueError, match="unknown system 'psd-tensorrt'"):
        group_systems(("psd-vllm", "psd-tensorrt"))


def test_a_front_takes_its_own_mode_and_batch_and_the_engines_ports(tiny_dirs, tmp_path):  # noqa: F811
    cfg = CompareConfig(out_dir=str(tmp_path), device="cpu", dtype="float32", target=tiny_dirs[0], draft=tiny_dirs[1],
                        m=4, k=3)
    engines = SharedEngines(("psd-native", "sd-native", "auto-native"), cfg, str(tmp_path / "engines"))
    assert (engines.stack_cfg.mode, engines.stack_cfg.max_num_seqs, engines.stack_cfg.num_engine_slots) == ("psd", 4, 8)
    fronts = {name: engines.front(name, str(tmp_path / name))._cfg for name in ("sd-native", "auto-native")}
    for front in fronts.values():
        assert (front.verifier_port, front.drafter_port, front.dist_port) == (
            engines.stack_cfg.verifier_port, engines.stack_cfg.drafter_port, engines.stack_cfg.dist_port)
        assert front.coordinator_port != engines.stack_cfg.coordinator_port and front.http_port != engines.stack_cfg.http_port
    # sd: one batch of 2m on the 2m slots; auto: two batches of m, adaptive k, the feedback balancer
    assert (fronts["sd-native"].mode, fronts["sd-native"].max_num_seqs, fronts["sd-native"].k_policy) == ("sd", 8, "fixed")
    assert (fronts["auto-native"].mode, fronts["auto-native"].max_num_seqs, fronts["auto-native"].k_policy,
            fronts["auto-native"].balancer) == ("auto", 4, "adaptive", "feedback")
    with pytest.raises(ValueError, match="does not run on the engines"):
        engines.front("psd-native-vsm70", str(tmp_path / "x"))


def test_the_report_names_the_systems_of_one_engine_start_and_each_ones_start_up():
    runs = [{"system": "vllm-ar", "concurrency": 1, "startup_s": 60.0}]
    runs += [{"system": name, "concurrency": c, "startup_s": s, "shared_engines": "psd-native", "engines_startup_s": 41.0}
             for name, s in (("psd-native", 2.5), ("sd-native", 3.0)) for c in (1, 4)]
    assert shared_engines(runs) == ["\nShared engines: psd-native, sd-native ran on one start of the engines (41 s), "
                                    "each behind its own coordinator and gateway (started in 2.5, 3.0 s)"]
    assert shared_engines(runs[:1]) == []


def test_tiny_cpu_run_of_three_modes_on_one_start_of_the_native_engines(tiny_dirs, tmp_path):  # noqa: F811
    data = tmp_path / "question.jsonl"
    data.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [turn]}) for i, turn in
                              enumerate(("Hi", "Translate: bonjour", "Count to three"), 1)) + "\n")
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--out-dir", str(out), "--work-dir", str(work), "--device", "cpu", "--dtype", "float32",
            "--target", tiny_dirs[0], "--draft", tiny_dirs[1], "--systems", "ar-native,psd-native,sd-native,auto-native",
            "--concurrencies", "1,2", "--max-tokens", "8", "--m", "1", "--k", "2", "--max-model-len", "256",
            "--num-warmup", "1", "--requests-per-client", "1", "--min-requests", "2", "--data", str(data)]
    proc = subprocess.run([sys.executable, "-m", "bench.engines.engines_compare", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["failures"] == []
    runs = {(r["system"], r["concurrency"]): r for r in results["runs"]}
    assert sorted(runs) == [(s, c) for s in ("ar-native", "auto-native", "psd-native", "sd-native") for c in (1, 2)]
    assert all(r["errors"] == [] and r["metrics"]["num_output_tokens"] == 16 for r in runs.values())
    assert "shared_engines" not in runs["ar-native", 1]
    for name in ("psd-native", "sd-native", "auto-native"):
        assert runs[name, 1]["shared_engines"] == "psd-native" and runs[name, 1]["engines_startup_s"] > 0
    # one verifier and one drafter for the three systems; each system its own coordinator and step log
    logs = work / "logs"
    assert sorted(p.name for p in (logs / "engines-psd-native").glob("*.log")) == ["drafter.log", "verifier.log"]
    for name in ("psd-native", "sd-native", "auto-native"):
        assert sorted(p.name for p in (logs / name).glob("*.log")) == ["coordinator.log", "gateway.log"]
        modes = {json.loads(line).get("mode") for line in (logs / name / "steps.jsonl").read_text().splitlines()}
        # psd falls back to sd while one of its batches is empty; sd never runs a psd step
        assert modes and modes <= {"sd": {"sd"}, "psd": {"sd", "psd"}, "auto": {"ar", "sd", "psd"}}[name.split("-")[0]]
    # lossless: greedy outputs of every speculative front equal ar's own stack
    outputs = json.loads((out / "outputs.json").read_text())
    for name in ("psd-native", "sd-native", "auto-native"):
        for c in (1, 2):
            assert outputs[f"{name}-c{c}"] == outputs[f"ar-native-c{c}"] and len(outputs[f"ar-native-c{c}"]) == 2
    assert "Shared engines: psd-native, sd-native, auto-native ran on one start" in (out / "results.md").read_text()


def test_engines_that_fail_to_start_or_die_fail_each_system_of_the_group_and_the_others_still_run(tmp_path, monkeypatch):
    from bench.engines import engines_compare

    class _Engines:
        start_deadline = None

        def __init__(self, names, cfg, logs):
            self.names = names

        def __enter__(self):
            if "sd-vllm" in self.names:
                raise RuntimeError("verifier exited with code 1")
            return self

        def __exit__(self, *exc):
            return None

        def check_alive(self):
            raise RuntimeError("drafter exited with code -9")

    ran = []
    monkeypatch.setattr(engines_compare, "SharedEngines", _Engines)
    monkeypatch.setattr(engines_compare, "run_system", lambda name, *a: ran.append(name) or [])
    cfg = CompareConfig(out_dir=str(tmp_path / "out"), data=str(_one_prompt(tmp_path)), concurrencies=(1,), min_requests=1,
                        systems=("sd-vllm", "psd-vllm", "vllm-ar", "psd-vllm-ses", "auto-vllm-ses"), requests_per_client=1)
    results = engines_compare.run_compare(cfg, "test")
    assert ran == ["vllm-ar"]
    errors = {f["system"]: f["error"] for f in results["failures"]}
    assert list(errors) == ["sd-vllm", "psd-vllm", "psd-vllm-ses", "auto-vllm-ses"]
    assert errors["psd-vllm"] == "RuntimeError: shared engines: verifier exited with code 1"
    assert errors["auto-vllm-ses"] == "RuntimeError: drafter exited with code -9"


def test_no_share_engines_starts_every_system_alone(tmp_path, monkeypatch):
    from bench.engines import engines_compare

    assert engines_compare.parse_args(["--out-dir", "x"]).share_engines is True
    cfg = engines_compare.parse_args(["--out-dir", str(tmp_path / "out"), "--no-share-engines", "--systems",
                                      "psd-vllm,sd-vllm", "--concurrencies", "1", "--requests-per-client", "1", "--min-requests", "1",
                                      "--data", str(_one_prompt(tmp_path))])
    started = []
    monkeypatch.setattr(engines_compare, "SharedEngines", lambda *a: pytest.fail("engines shared"))
    monkeypatch.setattr(engines_compare, "run_system", lambda name, *a: started.append(name) or [])
    assert engines_compare.run_compare(cfg, "test")["failures"] == [] and started == ["psd-vllm", "sd-vllm"]


def _one_prompt(tmp_path):
    data = tmp_path / "question.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "translation", "turns": ["Hi"]}) + "\n")
    return data


def test_a_run_naming_a_system_twice_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="systems: each system once"):
        CompareConfig(out_dir="x", systems=("vllm-ar", "psd-vllm", "vllm-ar"))
