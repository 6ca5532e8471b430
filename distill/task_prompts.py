"""Synthetic task prompts resembling Spec-Bench's task TYPES (never its content) for distillation.

Spec-Bench (Xia et al. 2024, arXiv 2401.07851, Sec. 3) mixes multi-turn chat, translation
(German -> English), summarization, QA, math reasoning and retrieval-augmented generation (RAG).
A draft distilled on chat prompts alone agrees with the target far less on the document tasks
(round 1: top-1 agreement 0.64 on held-out chat vs 0.37 on Spec-Bench), so distillation adds:

- ``summarization``: "Summarize: <document>" and variants; documents are human prose of
  ``distill.task_prose`` (``PROSE_SHARE`` of them; licences recorded) or the TARGET's own
  responses to the allowed chat prompts (1-3 joined);
- ``rag``: 3-5 prose excerpts + a question on the topic of one of them (``PROSE_SHARE``), or
  several target responses as passages + the question that produced one of them;
- ``translation``: German sentences of ``distill.task_corpus`` -> English (most), English
  sentences of the documents -> German / French;
- ``math_reasoning``: GSM8K-style multi-step word problems from templates with seeded numbers;
- ``qa``: short factual questions from templates over tz-database countries and cities and
  over the prose documents' topics;
- ``multi_turn``: chat prompt, the target's answer, a follow-up request.

Everything is deterministic for a seed. Prompts sharing any word ``EXCLUSION_NGRAM``-gram with a
Spec-Bench turn are dropped (:func:`eval_ngrams`, :func:`overlaps`), so Spec-Bench stays evaluation only.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from distill import math_problems

TASKS = ("summarization", "rag", "translation", "math_reasoning", "qa", "multi_turn")
TASK_SHARES = {"summarization": 0.22, "rag": 0.22, "translation": 0.16, "math_reasoning": 0.12, "qa": 0.16,
               "multi_turn": 0.12}
EXCLUSION_NGRAM = 10
MIN_DOC_CHARS = 300
MAX_PASSAGE_CHARS = 900
MAX_RAG_QUESTION_CHARS = 200
PROSE_SHARE = 0.75
TOPIC_QUESTIONS = ("What is {topic}?", "Describe {topic}.", "What does the text say about {topic}?",
                   "Explain {topic} in simple terms.", "how does {topic} work", "What are the main points about {topic}?",
                   "Summarize what the passages say about {topic}.", "what is {topic} used for?")
SUMMARIZE = ("Summarize: {doc}", "Summarize the following text.\n\n{doc}", "{doc}\n\nSummarize the text above.",
             "Write a short summary of this article:\n{doc}", "Summarize: {doc}\nS:", "TL;DR of the following:\n{doc}")
RAG = ("{passages}\n{question}", "Answer the question using the passages below.\n\n{passages}\n\nQuestion: {question}",
       "{passages}\n\nBased on the passages above, {question}", "Context:\n{passages}\n\nQuestion: {question}\nAnswer:")
TRANSLATE_DE = ("Translate German to English: {text}", "Translate German to English: {text}",
                "Translate the following German sentence into English: {text}", "Übersetze ins Englische: {text}")
TRANSLATE_EN = ("Translate English to German: {text}", "Translate English to French: {text}")
QA = ("what is the capital of {country}", "What is the capital of {country}?", "which continent is {country} in",
      "what currency is used in {country}?", "what language do they speak in {country}",
      "who is the head of state of {country}?", "when did {country} become independent",
      "what is the population of {country}?", "what is the largest city in {country}",
      "what is the national sport of {country}", "what country is {city} in?", "what is the population of {city}",
      "what time zone is {city} in", "what is {city} known for?", "which river flows through {city}",
      "how far is {city} from the sea", "when was {city} founded?", "who is the mayor of {city}")
FOLLOW_UPS = ("Can you make it shorter?", "Give me an example.", "Now explain it to a ten-year-old.",
              "Summarize your answer in three bullet points.", "Why is that?", "Can you rewrite it more formally?",
              "What are the main drawbacks?", "Translate your answer into German.", "Can you go into more detail on the first point?",
              "Now write it as a short poem.", "Are there any alternatives?", "What would change if the numbers doubled?")


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt: ``task`` (one of ``TASKS``) and chat ``messages`` ``({"role", "content"}, ...)``."""

    task: str
    messages: tuple[dict, ...]

    def text(self) -> str:
        """All message contents joined (for the exclusion check)."""
        return "\n".join(m["content"] for m in self.messages)


@dataclass(frozen=True)
class TaskMix:
    """How many prompts of each task (``counts``: task -> number) and the seed.

    Raises ValueError for an unknown task or a negative count.
    """

    counts: tuple[tuple[str, int], ...]
    seed: int = 0

    def __post_init__(self) -> None:
        for task, n in self.counts:
            if task not in TASKS:
                raise ValueError(f"counts: unknown task {task!r} (known: {', '.join(TASKS)})")
            if n < 0:
                raise ValueError(f"counts: {task} must be >= 0, got {n}")

    @classmethod
    def from_total(cls, total: int, seed: int = 0) -> "TaskMix":
        """``total`` prompts split by ``TASK_SHARES`` (rounded down, rest to the first task)."""
        counts = {t: int(total * TASK_SHARES[t]) for t in TASKS}
        counts[TASKS[0]] += total - sum(counts.values())
        return cls(tuple(counts.items()), seed)


def words(text: str) -> list[str]:
    """Lower-case word tokens (letters/digits) used by the exclusion check."""
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = EXCLUSION_NGRAM) -> set[tuple[str, ...]]:
    """All word ``n``-grams of ``text``."""
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


@dataclass(frozen=True)
class EvalNgrams:
    """Word n-grams of an evaluation set: ``grams`` holds every ``n``-gram of its texts and, for
    texts shorter than ``n`` words, the whole text; ``lengths`` the tuple lengths present."""

    grams: frozenset
    lengths: frozenset


def eval_ngrams(turns: list[str], n: int = EXCLUSION_NGRAM) -> EvalNgrams:
    """:class:`EvalNgrams` of the evaluation set's ``turns``."""
    grams: set[tuple[str, ...]] = set()
    for t in turns:
        grams |= ngrams(t, n) or {tuple(words(t))}
    return EvalNgrams(frozenset(grams), frozenset(len(g) for g in grams))


def overlaps(text: str, excluded: EvalNgrams) -> bool:
    """True when ``text`` contains any n-gram (or whole short text) of the evaluation set."""
    w = words(text)
    return any(tuple(w[i:i + k]) in excluded.grams for k in excluded.lengths for i in range(len(w) - k + 1))


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def _clip(text: str, max_chars: int) -> str:
    """``text`` cut at the last sentence/word end before ``max_chars``."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    end = max(cut.rfind(". "), cut.rfind("\n"))
    return cut[:end + 1] if end > max_chars // 2 else cut[:cut.rfind(" ")]


def topic(prose_doc: dict) -> str:
    """Short topic of a ``distill.task_prose`` document: its title up to the first ':'."""
    return prose_doc["title"].split(":")[0].strip()


def summarization(docs: list[tuple[str, str]], n: int, rng: random.Random,
                  prose: list[dict] | None = None) -> list[TaskPrompt]:
    """``n`` summarization prompts: one prose document (share ``PROSE_SHARE`` when ``prose``), else
    1-3 joined documents ``(question, answer)`` (answers used)."""
    long_docs = [a for _, a in docs if len(a) >= MIN_DOC_CHARS]
    if not long_docs and not prose:
        return []
    out = []
    for _ in range(n):
        if prose and (not long_docs or rng.random() < PROSE_SHARE):
            text = rng.choice(prose)["text"]
            doc = text if rng.random() < 0.5 else text[_start(text, rng):]
        else:
            doc = "\n\n".join(rng.sample(long_docs, min(rng.randint(1, 3), len(long_docs))))
        out.append(TaskPrompt("summarization", _user(rng.choice(SUMMARIZE).format(doc=doc))))
    return out


def rag(docs: list[tuple[str, str]], n: int, rng: random.Random, prose: list[dict] | None = None) -> list[TaskPrompt]:
    """``n`` RAG prompts: prose excerpts (share ``PROSE_SHARE`` when ``prose``, :func:`prose_rag`),
    else the answer to a short question among 2-4 other answers, then the question."""
    usable = [(q, a) for q, a in docs if len(q) <= MAX_RAG_QUESTION_CHARS and len(a) >= MIN_DOC_CHARS]
    if len(usable) < 2 and not (prose and len(prose) >= 3):
        return []
    out = []
    for _ in range(n):
        if prose and len(prose) >= 3 and (len(usable) < 2 or rng.random() < PROSE_SHARE):
            out.append(prose_rag(prose, rng))
            continue
        question, answer = rng.choice(usable)
        others = [a for q, a in rng.sample(usable, min(rng.randint(2, 4), len(usable) - 1) + 1) if q != question]
        passages = [_clip(p, MAX_PASSAGE_CHARS) for p in [answer, *others[:4]]]
        rng.shuffle(passages)
        out.append(TaskPrompt("rag", _user(rng.choice(RAG).format(passages="\n".join(passages), question=question))))
    return out


def prose_rag(prose: list[dict], rng: random.Random) -> TaskPrompt:
    """3-5 prose excerpts (<= ``MAX_PASSAGE_CHARS`` each, shuffled) + a ``TOPIC_QUESTIONS`` question
    on the topic of the first one, in one of the ``RAG`` layouts."""
    chosen = rng.sample(prose, rng.randint(3, 5))
    passages = [_clip(d["text"][_start(d["text"], rng):], MAX_PASSAGE_CHARS) for d in chosen]
    question = rng.choice(TOPIC_QUESTIONS).format(topic=topic(chosen[0]))
    rng.shuffle(passages)
    return TaskPrompt("rag", _user(rng.choice(RAG).format(passages="\n".join(passages), question=question)))


def _start(text: str, rng: random.Random) -> int:
    """A paragraph start in ``text`` (0 or after a blank line), chosen at random."""
    starts = [0] + [m.end() for m in re.finditer(r"\n\n", text) if m.end() < len(text) - MIN_DOC_CHARS // 2]
    return rng.choice(starts)


def translation(german: list[str], docs: list[tuple[str, str]], n: int, rng: random.Random) -> list[TaskPrompt]:
    """``n`` translation prompts: 80% German -> English (corpus), 20% English doc sentences -> DE/FR."""
    sentences = [s for _, a in docs for s in re.split(r"(?<=[.!?])\s+", a) if 40 <= len(s) <= 300 and "\n" not in s]
    out = []
    for _ in range(n):
        if german and (not sentences or rng.random() < 0.8):
            out.append(TaskPrompt("translation", _user(rng.choice(TRANSLATE_DE).format(text=rng.choice(german)))))
        elif sentences:
            out.append(TaskPrompt("translation", _user(rng.choice(TRANSLATE_EN).format(text=rng.choice(sentences)))))
    return out


def factual_qa(country_names: list[str], city_rows: list[dict], n: int, rng: random.Random,
               prose: list[dict] | None = None) -> list[TaskPrompt]:
    """``n`` short factual questions from ``QA`` templates over countries and cities; a quarter
    ``TOPIC_QUESTIONS`` over prose topics when ``prose``."""
    if not country_names or not city_rows:
        return []
    out = []
    for _ in range(n):
        if prose and rng.random() < 0.25:
            question = rng.choice(TOPIC_QUESTIONS[:6]).format(topic=topic(rng.choice(prose)))
            out.append(TaskPrompt("qa", _user(question)))
            continue
        template = rng.choice(QA)
        out.append(TaskPrompt("qa", _user(template.format(country=rng.choice(country_names),
                                                          city=rng.choice(city_rows)["city"]))))
    return out


def multi_turn(docs: list[tuple[str, str]], n: int, rng: random.Random) -> list[TaskPrompt]:
    """``n`` conversations: a chat prompt, the target's answer, a follow-up from ``FOLLOW_UPS``."""
    if not docs:
        return []
    out = []
    for _ in range(n):
        q, a = rng.choice(docs)
        out.append(TaskPrompt("multi_turn", ({"role": "user", "content": q}, {"role": "assistant", "content": a},
                                             {"role": "user", "content": rng.choice(FOLLOW_UPS)})))
    return out


def build_task_prompts(docs: list[tuple[str, str]], corpus: dict, mix: TaskMix,
                       excluded: EvalNgrams | None = None) -> list[TaskPrompt]:
    """Deterministic task prompts for ``mix`` (shuffled; at most the requested number per task).

    Args:
        docs: ``(chat prompt, target response)`` texts; the document source.
        corpus: ``distill.task_corpus.collect()`` (keys german, countries, cities, prose; missing = empty).
        mix: counts per task + seed.
        excluded: :func:`eval_ngrams` of the evaluation set; overlapping prompts are dropped.
    Returns: the prompts; a task lacking its source text (e.g. no German) yields none.
    """
    rng = random.Random(mix.seed)
    german = [row["de"] for row in corpus.get("german", [])]
    prose = corpus.get("prose") or None
    makers = {"summarization": lambda k: summarization(docs, k, rng, prose), "rag": lambda k: rag(docs, k, rng, prose),
              "translation": lambda k: translation(german, docs, k, rng),
              "math_reasoning": lambda k: math_problems.word_problems(k, rng),
              "qa": lambda k: factual_qa(corpus.get("countries", []), corpus.get("cities", []), k, rng, prose),
              "multi_turn": lambda k: multi_turn(docs, k, rng)}
    out = []
    for task, count in mix.counts:
        made = [p if isinstance(p, TaskPrompt) else TaskPrompt(task, _user(p)) for p in makers[task](count)]
        unique = list({p.text(): p for p in made}.values())
        out += [p for p in unique if excluded is None or not overlaps(p.text(), excluded)]
    rng.shuffle(out)
    return out


def mix_summary(prompts: list[TaskPrompt]) -> dict[str, int]:
    """Number of prompts per task (all of ``TASKS``, zero included)."""
    return {t: sum(p.task == t for p in prompts) for t in TASKS}
