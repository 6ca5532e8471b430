"""Synthetic task prompts (distill.task_prompts, math_problems, task_corpus): deterministic, every
task type present, no Spec-Bench overlap."""

from __future__ import annotations

import json
import random

import pytest

from distill import math_problems
from distill import task_corpus
from distill import task_prompts as tp

from conftest import SPEC_BENCH, needs_spec_bench
DOCS = [(f"Question number {i} about topic {i % 7}?",
         " ".join(f"Sentence {j} of answer {i} explains the topic in plain words." for j in range(8)))
        for i in range(40)]
CORPUS = {"german": [{"de": f"Dies ist der deutsche Satz Nummer {i} mit einigen Wörtern.", "package": "x"}
                     for i in range(30)],
          "countries": ["Norway", "Chile", "Kenya"], "cities": [{"city": "Oslo", "country": "Norway"}]}


def _build(seed=0, total=120, excluded=None):
    return tp.build_task_prompts(DOCS, CORPUS, tp.TaskMix.from_total(total, seed=seed), excluded)


def test_builder_is_deterministic_for_a_seed_and_varies_with_it():
    assert _build(seed=3) == _build(seed=3)
    assert _build(seed=3) != _build(seed=4)


def test_every_task_type_is_present_with_its_shape():
    prompts = _build()
    counts = tp.mix_summary(prompts)
    assert set(counts) == set(tp.TASKS) and all(n > 0 for n in counts.values()), counts
    for p in prompts:
        assert p.messages[-1]["role"] == "user"
        if p.task == "multi_turn":
            assert [m["role"] for m in p.messages] == ["user", "assistant", "user"]
        if p.task == "rag":  # the question that produced one of the passages
            assert any(q in p.text() and a[:60] in p.text() for q, a in DOCS)
        if p.task == "summarization":
            assert any(a[:60] in p.text() for _, a in DOCS)


def test_mix_counts_and_validation():
    mix = tp.TaskMix.from_total(100)
    assert sum(n for _, n in mix.counts) == 100 and dict(mix.counts)["math_reasoning"] == 12
    with pytest.raises(ValueError, match="counts"):
        tp.TaskMix((("poetry", 3),))
    with pytest.raises(ValueError, match="counts"):
        tp.TaskMix((("qa", -1),))


def test_prompts_overlapping_the_evaluation_set_are_dropped():
    leaked = DOCS[0][1].split(". ")[2]  # one sentence of a document
    excluded = tp.eval_ngrams([leaked, "what is the capital of norway"])
    kept = _build(excluded=excluded)
    assert kept and not any(tp.overlaps(p.text(), excluded) for p in kept)
    assert len(kept) < len(_build())
    assert not any(p.text().lower().rstrip("?") == "what is the capital of norway" for p in kept)
    assert tp.overlaps("so: What is the capital of Norway?", excluded)
    assert not tp.overlaps("what is the capital of chile", excluded)


@needs_spec_bench
def test_real_spec_bench_does_not_overlap_the_built_prompts():
    with open(SPEC_BENCH, encoding="utf-8") as f:
        turns = [t for row in map(json.loads, filter(str.strip, f)) for t in row["turns"]]
    excluded = tp.eval_ngrams(turns)
    prompts = _build(total=300, excluded=excluded)
    assert all(n > 0 for n in tp.mix_summary(prompts).values())
    texts = {p.text() for p in prompts}
    assert not texts & set(turns)
    assert not any(tp.overlaps(t, excluded) for t in texts)


def test_math_problems_are_seeded_word_problems():
    a, b = math_problems.word_problems(50, random.Random(1)), math_problems.word_problems(50, random.Random(1))
    assert a == b and len(set(a)) > 40
    assert all(any(ch.isdigit() for ch in q) and q.endswith("?") for q in a)


def test_corpus_prose_filter_and_collect_shape():
    assert task_corpus.is_prose("Die Datei konnte nicht geöffnet werden, bitte erneut versuchen.")
    assert not task_corpus.is_prose("Datei %s nicht gefunden, bitte erneut versuchen jetzt sofort")
    assert not task_corpus.is_prose("zu kurz")
    corpus = task_corpus.collect()
    assert set(corpus) == {"german", "countries", "cities", "prose", "prose_sources", "sources"}
    assert all(task_corpus.is_prose(row["de"]) for row in corpus["german"])


PROSE = [{"title": f"Library {i}: a thing", "source": "test", "licence": "MIT",
          "text": "\n\n".join(f"Paragraph {j} of library {i} describes how the library {i} works in prose." * 3
                              for j in range(6))} for i in range(10)]


def test_prose_documents_feed_summarization_rag_and_qa():
    prompts = tp.build_task_prompts(DOCS, {**CORPUS, "prose": PROSE}, tp.TaskMix.from_total(200, seed=1))
    by_task = {t: [p.text() for p in prompts if p.task == t] for t in tp.TASKS}
    assert all(by_task.values()), tp.mix_summary(prompts)
    from_prose = [t for t in by_task["summarization"] if "Paragraph" in t]
    assert len(from_prose) > len(by_task["summarization"]) // 2  # PROSE_SHARE of them
    prose_rag = [t for t in by_task["rag"] if "Paragraph" in t]
    assert prose_rag and all(t.count("Paragraph") >= 3 for t in prose_rag)
    assert all(any(f"Library {i}" in t.split("Paragraph")[-1] for i in range(10)) for t in prose_rag)  # topic question
    assert any("Library" in t for t in by_task["qa"])
    assert tp.topic(PROSE[0]) == "Library 0"
