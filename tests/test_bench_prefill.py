"""bench/cpu/prefill.py on a tiny random model (CPU twin of the GPU admission benchmark)."""

from __future__ import annotations

import json

from bench.cpu import prefill
from specdec.kv import slot_attention


def test_prefill_bench_times_both_variants_and_labels_random_weights(tmp_path):
    before = list(slot_attention.DYNAMIC_SDPA_BACKENDS)
    result = prefill.main(["--model", "random:tiny-llama", "--num-prompts", "3", "--num-reps", "2",
                           "--min-len", "4", "--max-len", "12", "--with-cudnn", "--out", str(tmp_path)])
    assert set(result["variants"]) == {"one_per_forward", "batched"}          # no cuDNN variant on CPU
    assert all(len(times) == 2 and min(times) > 0 for times in result["variants"].values())
    assert [len(rep) for rep in result["lengths"]] == [3, 3]
    assert all(4 <= n <= 12 for rep in result["lengths"] for n in rep)
    saved = json.loads((tmp_path / "prefill.json").read_text())
    assert saved["variants"] == result["variants"]
    assert "RANDOM WEIGHTS" in (tmp_path / "prefill.md").read_text()
    assert slot_attention.DYNAMIC_SDPA_BACKENDS == before


def test_allowing_cudnn_is_undone_after_the_variant(monkeypatch):
    seen = []
    monkeypatch.setattr(prefill, "time_adds", lambda *a: seen.append(list(slot_attention.DYNAMIC_SDPA_BACKENDS)) or [1.0])
    args = prefill.argparse.Namespace(model="random:tiny-llama", dtype="float32", device="cpu", num_prompts=2,
                                      max_len=8, seed=0)
    before = list(slot_attention.DYNAMIC_SDPA_BACKENDS)
    prefill.run_variant(args, 0, True, [[3, 4]])
    assert "CUDNN_ATTENTION" in str(seen[0]) and slot_attention.DYNAMIC_SDPA_BACKENDS == before


def test_profile_writes_op_and_python_tables(tmp_path):
    prefill.main(["--model", "random:tiny-llama", "--num-prompts", "1", "--num-reps", "1", "--min-len", "4",
                  "--max-len", "12", "--profile", "2", "--out", str(tmp_path)])
    report = (tmp_path / "prefill_profile.txt").read_text()
    assert report.startswith("2 one-prompt add_requests")
    assert "aten::mm" in report or "aten::addmm" in report  # the op table
    assert "add_requests" in report and "cumulative" in report  # cProfile's table, sorted by cumulative time


def test_check_paths_compares_the_causal_shortcut_with_the_mask(tmp_path):
    result = prefill.main(["--model", "random:tiny-llama", "--num-prompts", "1", "--num-reps", "1", "--min-len", "4",
                           "--max-len", "12", "--check-paths", "--out", str(tmp_path)])
    check = result["causal_vs_mask"]
    assert check["is_argmax_equal"] and 0.0 <= check["max_abs_logit_diff"] < 1e-4   # float32, CPU
    assert "causal shortcut vs explicit mask" in (tmp_path / "prefill.md").read_text()
