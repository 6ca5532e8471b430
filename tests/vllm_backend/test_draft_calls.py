"""``bench.engines.draft_calls`` on vLLM's CPU build (run in ``.venv-vllm``): both draft-engine
set-ups run, and the results say what each call cost; with ``drafting_config``'s defaults a call
of k drafts takes k engine steps even when 24 rows catch up at once, while vLLM's CPU defaults
(128-token blocks, a 256-token step budget here) split the catch-ups over more steps."""
from __future__ import annotations

import json

import pytest

from bench.engines import draft_calls


def test_both_setups_run_and_only_the_drafting_one_takes_k_steps_per_call(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path / "cache"))
    assert draft_calls.main(["--device", "cpu", "--dtype", "float32", "--draft", "random:tiny-llama-hd64",
                             "--enforce-eager", "--rows", "2,24", "--k", "3", "--num-calls", "3", "--num-warmup", "1",
                             "--max-model-len", "256", "--out-dir", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    points = {(r["setup"], r["rows"]): r for r in result["rows"]}
    assert set(points) == {(s, n) for s in ("drafting", "vllm-default") for n in (2, 24)}
    assert [points["drafting", n]["steps_per_call"] for n in (2, 24)] == [3.0, 3.0]
    assert points["vllm-default", 24]["block_size"] == 128 and points["vllm-default", 24]["steps_per_call"] > 3
    assert all(r["ms_per_call"] > 0 and r["add_request_ms_per_call"] > 0 for r in result["rows"])
    for r in result["rows"]:   # the call's steps are its first step and k - 1 later ones, within its wall time
        assert r["first_step_ms"] > 0 and r["later_step_ms"] > 0 and r["decode_step_ms"] > 0
        steps_ms = r["first_step_ms"] + (r["steps_per_call"] - 1) * r["later_step_ms"]
        assert steps_ms == pytest.approx(r["step_ms_per_call"])
        assert r["step_ms_per_call"] <= r["ms_per_call"]
    # the same greedy drafts from both engines (float32, same weights and inputs; the first set-up is the reference)
    assert [points["drafting", n]["drafts_equal_to_first_setup"] for n in (2, 24)] == [1.0, 1.0]
    assert min(points["vllm-default", n]["drafts_equal_to_first_setup"] for n in (2, 24)) >= 0.9
    assert "| 32 | 1152 | None | 24 |" in (tmp_path / "out" / "results.md").read_text()
    assert all("profile_ms_per_call" not in r for r in result["rows"])   # only with --profile


def test_profile_splits_a_call_into_vllm_s_parts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path / "cache"))
    assert draft_calls.main(["--device", "cpu", "--dtype", "float32", "--draft", "random:tiny-llama-hd64",
                             "--enforce-eager", "--rows", "8", "--k", "3", "--num-calls", "3", "--num-warmup", "1",
                             "--max-model-len", "256", "--setups", "drafting,sessions", "--profile",
                             "--out-dir", str(tmp_path / "out")]) == 0
    row, session_row = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    parts = row["profile_ms_per_call"]
    for name in ("llm_engine.py:add_request", "scheduler.py:schedule", "gpu_model_runner.py:execute_model"):
        assert 0 < parts[name] < row["ms_per_call"] * 1.5, (name, parts)   # cProfile's own overhead aside
    assert parts["gpu_model_runner.py:_model_forward"] < parts["gpu_model_runner.py:execute_model"]
    # a resumed session: no admission, the scheduler's session update and the runner's re-add instead
    session_parts = session_row["profile_ms_per_call"]
    assert session_row["setup"] == "sessions" and "llm_engine.py:add_request" not in session_parts
    for name in ("scheduler.py:_update_request_as_session", "gpu_model_runner.py:_update_states"):
        assert 0 < session_parts[name] < session_parts["gpu_model_runner.py:execute_model"], (name, session_parts)


@pytest.mark.parametrize("prompt_tokens, max_model_len, fits", [(8, 256, True), (100, 256, True), (122, 256, True), (123, 256, False),
                                                                 (0, 256, False)])
def test_prompt_tokens_must_leave_every_row_room_for_its_calls(prompt_tokens, max_model_len, fits, capsys) -> None:
    argv = ["--device", "cpu", "--draft", "random:tiny-llama-hd64", "--rows", "2,24", "--k", "3", "--num-calls", "3",
            "--num-warmup", "1", "--max-model-len", str(max_model_len), "--prompt-tokens", str(prompt_tokens),
            "--out-dir", "x"]
    if fits:   # the longest row: P + 5 x 23 + 4 calls x 4 tokens + k
        assert draft_calls._parse(argv).prompt_tokens == prompt_tokens
        return
    with pytest.raises(SystemExit):
        draft_calls._parse(argv)
    assert "--prompt-tokens" in capsys.readouterr().err


def test_slots_default_to_the_largest_row_count_and_may_not_be_fewer(capsys) -> None:
    argv = ["--device", "cpu", "--draft", "random:tiny-llama-hd64", "--rows", "2,24", "--out-dir", "x"]
    assert draft_calls._parse(argv).slots == 24 and draft_calls._parse(argv + ["--slots", "64"]).slots == 64
    with pytest.raises(SystemExit):
        draft_calls._parse(argv + ["--slots", "16"])
    assert "--slots" in capsys.readouterr().err


def test_the_sessions_setup_drafts_what_drafting_does_without_admitting_rows(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path / "cache"))
    assert draft_calls.main(["--device", "cpu", "--dtype", "float32", "--draft", "random:tiny-llama-hd64",
                             "--enforce-eager", "--rows", "8", "--k", "3", "--num-calls", "3", "--num-warmup", "1",
                             "--max-model-len", "512", "--prompt-tokens", "200", "--setups", "drafting,sessions",
                             "--out-dir", str(tmp_path / "out")]) == 0
    rows = {r["setup"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]}
    assert rows["sessions"]["add_request_ms_per_call"] == 0 < rows["drafting"]["add_request_ms_per_call"]
    assert rows["sessions"]["steps_per_call"] == 3.0 and rows["sessions"]["drafts_equal_to_first_setup"] == 1.0


def test_a_minedraft_draft_dir_is_timed_over_its_target_and_refused_without_one(tmp_path, monkeypatch) -> None:
    # table (a)'s distilled draft borrows the target's embeddings and head: --target names the target
    from conftest import _build_tiny_llama
    from specdec.models.draft_format import make_truncated_draft
    from test_multi_step_decode import SHAPE

    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path / "cache"))
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    _build_tiny_llama(num_layers=2, seed=3, vocab_size=1024, **SHAPE).save_pretrained(target, safe_serialization=True)
    make_truncated_draft(target, [0], draft)
    argv = ["--device", "cpu", "--dtype", "float32", "--draft", draft, "--enforce-eager", "--rows", "2", "--k", "3",
            "--num-calls", "2", "--num-warmup", "1", "--max-model-len", "256", "--setups", "drafting",
            "--out-dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="the target model must be given"):
        draft_calls.main(argv)
    assert draft_calls.main([*argv, "--target", target]) == 0
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert row["rows"] == 2 and row["steps_per_call"] == 3.0 and row["ms_per_call"] > 0
