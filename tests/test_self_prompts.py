"""Self-written distillation prompts (distill.self_prompts, Magpie): template, filters, chunked stage."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from distill import run as distill
from distill import self_prompts
from distill import task_prompts

EVAL = task_prompts.eval_ngrams(["Summarize the following news article about the harbour bridge repairs."])


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_pre_query_template_is_the_chat_template_up_to_the_user_text(tokenizer):
    ids = self_prompts.pre_query_ids(tokenizer)
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=True,
                                         return_dict=False)
    assert list(full[:len(ids)]) == ids
    assert tokenizer.decode(ids).endswith("<|im_start|>user\n")


def test_keep_queries_drops_incomplete_short_duplicate_and_evaluation_text():
    seen = {"an old query we had"}
    texts = ["", "Hi there", "How do I bake rye bread at home?", "how do I  bake rye bread at HOME?",
             "An old query we had", "Please summarize the following news article about the harbour bridge repairs, thanks",
             "Write a poem about autumn leaves."]
    kept = self_prompts.keep_queries(texts, EVAL, seen)
    assert kept == ["How do I bake rye bread at home?", "Write a poem about autumn leaves."]
    assert "write a poem about autumn leaves." in seen


def _target(tiny_llama, tokenizer):
    model = tiny_llama(num_layers=1, vocab_size=len(tokenizer), max_position_embeddings=512, seed=5)
    # a random tiny model never ends a turn by itself; force the end-of-turn id at the length limit
    model.generation_config.forced_eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model


def _stage(cfg, model, tokenizer, cache, t0):
    def cached(name, make, skip=False):
        if name not in cache:
            if skip:
                return None
            cache[name] = make()
        return cache[name]

    def answer(prompts):
        return distill.generate_responses(model, prompts, cfg, (tokenizer.eos_token_id,), 0, 0.0)

    return self_prompts.build_self_stage(cfg, model, tokenizer, EVAL, answer, cached, t0)


def test_self_stage_samples_answers_and_caches_each_chunk(tmp_path, tiny_llama, tokenizer):
    model = _target(tiny_llama, tokenizer)
    cfg = distill.DistillConfig(target="unused", out_dir=str(tmp_path), num_self_prompts=10, gen_batch_size=4,
                                max_self_prompt_tokens=12, max_new_tokens=3)
    cache: dict = {}
    pairs, summary = _stage(cfg, model, tokenizer, cache, time.perf_counter())
    assert set(cache) == {"self0.pt", "self1.pt", "self2.pt"}
    assert summary["num_self_prompts_sampled"] == 10 and summary["num_self_prompts_kept"] == len(pairs) > 0
    pre = self_prompts.pre_query_ids(tokenizer)
    queries = [q for v in cache.values() for q in v["queries"]]
    assert len({q.lower() for q in queries}) == len(queries)
    for prompt, response in pairs:
        assert prompt[:len(pre)] == pre and 1 <= len(response) <= 3
    again, _ = _stage(cfg, model, tokenizer, cache, time.perf_counter())  # resumes from the cache
    assert again == pairs


def test_data_budget_stops_new_chunks_but_keeps_cached_ones(tmp_path, tiny_llama, tokenizer):
    model = _target(tiny_llama, tokenizer)
    cfg = distill.DistillConfig(target="unused", out_dir=str(tmp_path), num_self_prompts=8, gen_batch_size=4,
                                max_self_prompt_tokens=12, max_new_tokens=2, data_budget_s=5.0)
    long_ago = time.perf_counter() - 60
    cache: dict = {}
    assert _stage(cfg, model, tokenizer, cache, long_ago) == ([], {
        "num_self_prompts_sampled": 0, "num_self_prompts_kept": 0,
        "self_prompt_method": "Magpie (Xu et al. 2024, arXiv 2406.08464): target-sampled user queries"})
    assert cache == {}
    first, _ = _stage(cfg, model, tokenizer, cache, time.perf_counter())
    assert set(cache) == {"self0.pt", "self1.pt"}
    late, summary = _stage(cfg, model, tokenizer, cache, long_ago)
    assert late == first and summary["num_self_prompts_sampled"] == 8


def test_cli_flags_of_the_self_stage():
    cfg = distill.parse_args(["--out", "d", "--num-self-prompts", "4096", "--data-budget-s", "300", "--data-only"])
    assert cfg.num_self_prompts == 4096 and cfg.data_budget_s == 300.0 and cfg.is_data_only
    assert not distill.parse_args(["--out", "d"]).is_data_only
    with pytest.raises(ValueError, match="self_prompt_temperature"):
        distill.DistillConfig(target="t", out_dir="o", self_prompt_temperature=0.0)
    with pytest.raises(SystemExit) as exc:  # the CLI names the field in a usage error, no traceback
        distill.parse_args(["--out", "d", "--num-self-prompts", "-1"])
    assert exc.value.code == 2


def _data_dir(tmp_path):
    (tmp_path / "data" / "arena_hard").mkdir(parents=True)
    rows = [{"prompt": f"Explain how a {w} works, in two sentences."} for w in ("pump", "lock", "kite", "bell")]
    (tmp_path / "data" / "arena_hard" / "arena-hard-v0.1_question.jsonl").write_text(
        "\n".join(__import__("json").dumps(r) for r in rows))
    return str(tmp_path / "data")


def test_teacher_logits_follow_the_data_when_a_rerun_adds_self_prompts(tmp_path, tiny_llama, tokenizer):
    model = _target(tiny_llama, tokenizer)
    base = dict(target="unused", out_dir=str(tmp_path / "o"), work_dir=str(tmp_path / "w"), data_dir=_data_dir(tmp_path),
                num_heldout=1, max_new_tokens=3, gen_batch_size=4, max_self_prompt_tokens=12, top_k_logits=4)
    (tmp_path / "w").mkdir()
    for num_self in (4, 8):  # the second run keeps the cached chunk and samples one more
        cfg = distill.DistillConfig(**base, num_self_prompts=num_self)
        pairs, teacher, _, _, _ = distill.build_dataset(cfg, model, tokenizer, "cpu")
        assert len(teacher) == len(pairs) and [len(v) for v, _ in teacher] == [len(r) for _, r in pairs]
    assert len(list((tmp_path / "w").glob("teacher_*.pt"))) == 2


def test_missing_data_dir_and_unreadable_cache_are_named(tmp_path, tiny_llama, tokenizer):
    model = _target(tiny_llama, tokenizer)
    cfg = distill.DistillConfig(target="unused", out_dir=str(tmp_path / "o"), work_dir=str(tmp_path),
                                data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="data_dir"):
        distill.build_dataset(cfg, model, tokenizer, "cpu")
    (tmp_path / "self0.pt").write_bytes(b"not a torch file")
    from distill.data import _cached
    with pytest.raises(RuntimeError, match="self0.pt is unreadable"):
        _cached(str(tmp_path / "self0.pt"), lambda: None)
