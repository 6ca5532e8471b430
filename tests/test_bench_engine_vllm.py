"""bench/engines/engine_vllm.py: ours end to end on a tiny model (--skip-vllm), and vLLM's decode arithmetic."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from bench.engines import engine_vllm


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer (and its chat template)."""
    from transformers import AutoTokenizer

    from conftest import _build_tiny_llama
    from specdec.models.gguf import packaged_gguf_path

    path = str(tmp_path_factory.mktemp("tiny"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                              gguf_file=os.path.basename(packaged_gguf_path()))
    _build_tiny_llama(num_layers=2, vocab_size=49152, max_position_embeddings=engine_vllm.MAX_MODEL_LEN
                      ).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> str:
    """Two Spec-Bench-format questions (the shared data need not be beside the checkout)."""
    path = tmp_path_factory.mktemp("data") / "question.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [text]}) for i, text in
                              enumerate(("Write a haiku about rain.", "Explain what a KV cache is."))) + "\n")
    return str(path)


def test_ours_only_end_to_end_writes_consistent_positive_figures(tiny_model_dir, questions, tmp_path):
    affinity = os.sched_getaffinity(0)
    result = engine_vllm.main(["--model", tiny_model_dir, "--num-prompts", "2", "--num-steps", "2",
                               "--skip-vllm", "--out-dir", str(tmp_path), "--data", questions])
    assert os.sched_getaffinity(0) == affinity                      # the pin is undone
    saved = json.loads((tmp_path / "results.json").read_text())
    cfg, ours = saved["config"], saved["ours"]
    assert cfg["num_prompts"] == 2 and cfg["num_steps"] == 2 and cfg["dtype"] == "float32"
    assert len(cfg["prompt_lens"]) == 2 and min(cfg["prompt_lens"]) > 0
    assert cfg["prompt_tokens"] == sum(cfg["prompt_lens"])
    assert cfg["core"] in affinity
    assert ours["prefill_s"] > 0
    assert len(ours["step_ms"]) == 2 and min(ours["step_ms"]) > 0
    assert ours["decode_ms_median"] == pytest.approx(statistics.median(ours["step_ms"]))
    assert ours["decode_ms_mean"] == pytest.approx(statistics.mean(ours["step_ms"]))
    assert saved["vllm"] is None and saved["ratios"] is None
    assert saved["git_commit"] and saved["machine"] and saved["date"]
    assert saved["ours"] == result["ours"]
    table = (tmp_path / "results.md").read_text()
    assert "| ours |" in table and "| vLLM" not in table and "ours / vLLM" not in table


def test_same_prompts_as_token_ids_through_the_chat_template(tiny_model_dir, questions):
    ids = engine_vllm.prompt_ids(tiny_model_dir, questions, 2)
    assert len(ids) == 2 and all(isinstance(t, int) for row in ids for t in row)
    assert ids[0] != ids[1] and ids[0][0] == ids[1][0]              # same chat header, different text


def test_zero_steps_is_refused():
    with pytest.raises(SystemExit):
        engine_vllm.parse_args(["--num-steps", "0", "--skip-vllm"])


def test_vllm_decode_step_is_the_difference_of_the_two_long_generates_per_step():
    figures = engine_vllm.vllm_figures({"1": 18.5, "65": 29.5, "129": 40.3}, 64)
    assert figures["prefill_s"] == 18.5
    assert figures["decode_ms_per_step"] == pytest.approx((40.3 - 29.5) / 64 * 1e3)
    ours = {"prefill_s": 20.0, "decode_ms_mean": 225.0, "decode_ms_median": 220.0}
    ratios = engine_vllm.ratios(ours, figures)
    assert ratios["prefill"] == pytest.approx(20.0 / 18.5)
    assert ratios["decode_step_mean"] == pytest.approx(225.0 / figures["decode_ms_per_step"])
    with pytest.raises(ValueError):                                 # no growth: a broken measurement
        engine_vllm.vllm_figures({"1": 1.0, "3": 2.0, "5": 2.0}, 2)
    with pytest.raises(KeyError):                                   # timings for another S
        engine_vllm.vllm_figures({"1": 1.0, "3": 2.0, "5": 3.0}, 4)
