"""The one load generator of the benchmark suite: streaming OpenAI chat completions (issue 8).

Every system (our gateway's HTTP API and ``vllm serve``) is driven by this same code through
``openai.AsyncOpenAI`` with ``stream=True`` and ``stream_options.include_usage``, so TTFT and
latency are measured identically:

- ``ttft_ms``: from sending the request to the first streamed chunk whose delta carries text (ms);
- ``latency_ms``: from sending the request to the end of the stream (ms, end-to-end latency);
- ``itl_ms``: the gaps between consecutive chunks whose delta carries text (ms; inter-token
  latency as vLLM's benchmark_serving measures it, per streamed chunk);
- ``num_output_tokens``: ``usage.completion_tokens`` of the final usage chunk (tokens);
- ``spec``: our gateway's ``usage.minedraft`` extension (draft/accepted tokens, number of drafts)
  when present, else None (vLLM reports speculation only in its /metrics).

At most ``concurrency`` requests are in flight at once (a closed loop: a new request starts when
one finishes), the way vLLM's and Spec-Bench's throughput benchmarks keep a fixed load.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_BENCH_TASK = "mt_bench"
SPEC_BENCH_TASKS = (MT_BENCH_TASK, "translation", "summarization", "qa", "math_reasoning", "rag")
NO_SEED = None


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: Spec-Bench question id, task (``SPEC_BENCH_TASKS``) and first turn."""

    prompt_id: str
    task: str
    text: str


@dataclass(frozen=True)
class LoadConfig:
    """One load run against an OpenAI-compatible endpoint.

    Attributes:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        model: served model id.
        concurrency: requests in flight at once (closed loop).
        max_tokens: output tokens per request.
        temperature: 0 = greedy.
        seed: base sampling seed; request i gets ``seed + i`` (None = unseeded).
        ignore_eos: keep generating past EOS so every request yields ``max_tokens`` tokens.
        timeout_s: per-request timeout (s).
    """

    base_url: str
    model: str
    concurrency: int
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = NO_SEED
    ignore_eos: bool = False
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        for name, is_ok in (("concurrency", self.concurrency >= 1), ("max_tokens", self.max_tokens >= 1),
                            ("temperature", self.temperature >= 0), ("timeout_s", self.timeout_s > 0),
                            ("base_url", self.base_url.startswith("http"))):
            if not is_ok:
                raise ValueError(f"{name}: out of range, got {getattr(self, name)!r}")


@dataclass
class RequestResult:
    """What one streamed request returned (times in ms, Unix seconds for start/end)."""

    prompt_id: str
    task: str
    text: str = ""
    num_output_tokens: int = 0
    ttft_ms: float = float("nan")
    latency_ms: float = float("nan")
    itl_ms: list[float] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0
    finish_reason: str = ""
    spec: dict | None = None
    error: str = ""

    @property
    def is_ok(self) -> bool:
        return not self.error


@dataclass
class LoadRun:
    """All requests of one load run and its wall time (s, first send to last stream end)."""

    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0


def load_spec_bench(path: str, num_prompts: int, tasks: tuple[str, ...] = SPEC_BENCH_TASKS) -> list[Prompt]:
    """``num_prompts`` first turns from a Spec-Bench ``question.jsonl``, taken round-robin over
    ``tasks`` (MT-bench's 8 categories form the task ``mt_bench``), in file order within a task.

    Raises:
        ValueError: an unknown task, ``num_prompts`` < 1, or too few rows for the request.
    """
    unknown = [t for t in tasks if t not in SPEC_BENCH_TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks: unknown {unknown} (choose from {SPEC_BENCH_TASKS})")
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    by_task: dict[str, list[Prompt]] = {t: [] for t in tasks}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            task = MT_BENCH_TASK if row.get("category") in MT_BENCH_CATEGORIES else row.get("category")
            if task in by_task and row.get("turns"):
                by_task[task].append(Prompt(str(row.get("question_id")), task, row["turns"][0]))
    prompts, index = [], 0
    while len(prompts) < num_prompts:
        if all(index >= len(rows) for rows in by_task.values()):
            raise ValueError(f"num_prompts: only {len(prompts)} prompts of tasks {tasks} in {path}")
        prompts += [rows[index] for rows in by_task.values() if index < len(rows)][:num_prompts - len(prompts)]
        index += 1
    return prompts


async def _one(client, cfg: LoadConfig, prompt: Prompt, index: int) -> RequestResult:
    result = RequestResult(prompt.prompt_id, prompt.task)
    extra = {"ignore_eos": True} if cfg.ignore_eos else {}
    if cfg.seed is not None:
        extra["seed"] = cfg.seed + index
    parts: list[str] = []
    result.start_s = time.time()
    start = last = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=cfg.model, messages=[{"role": "user", "content": prompt.text}], max_tokens=cfg.max_tokens,
            temperature=cfg.temperature, stream=True, stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    now = time.perf_counter()
                    if not parts:
                        result.ttft_ms = (now - start) * 1e3
                    else:
                        result.itl_ms.append(round((now - last) * 1e3, 3))
                    last = now
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                result.num_output_tokens = chunk.usage.completion_tokens
                result.spec = (chunk.usage.model_extra or {}).get("minedraft")
    except Exception as exc:  # noqa: BLE001 -- any failure is recorded per request, not fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"[:500]
    result.latency_ms = (time.perf_counter() - start) * 1e3
    result.end_s = time.time()
    result.text = "".join(parts)
    return result


async def run_load_async(prompts: list[Prompt], cfg: LoadConfig, on_done=None) -> LoadRun:
    """Send every prompt with at most ``cfg.concurrency`` in flight; ``on_done(result)`` after each."""
    import openai

    semaphore = asyncio.Semaphore(cfg.concurrency)
    async with openai.AsyncOpenAI(base_url=cfg.base_url, api_key="EMPTY", timeout=cfg.timeout_s,
                                  max_retries=0) as client:
        async def bounded(index: int, prompt: Prompt) -> RequestResult:
            async with semaphore:
                result = await _one(client, cfg, prompt, index)
            if on_done is not None:
                on_done(result)
            return result

        run = LoadRun(start_s=time.time())
        start = time.perf_counter()
        run.results = list(await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts))))
        run.wall_s = time.perf_counter() - start
        run.end_s = time.time()
    return run


def run_load(prompts: list[Prompt], cfg: LoadConfig, on_done=None) -> LoadRun:
    """Blocking wrapper of ``run_load_async``."""
    return asyncio.run(run_load_async(prompts, cfg, on_done))


@dataclass(frozen=True)
class BurstConfig:
    """A seeded bursty open-loop arrival trace (issue 10: load that changes during a run).

    ``num_bursts`` bursts; each brings a uniform random number of requests in
    ``[min_burst_size, max_burst_size]``, arriving uniformly within ``burst_spread_s`` seconds;
    between bursts a quiet gap, uniform in ``[min_gap_s, max_gap_s]`` seconds, in which
    ``num_trickle`` single requests arrive evenly spaced (so the load swings from one request to
    a whole burst and back). Arrival times do not depend on the service (open loop).
    """

    num_bursts: int = 3
    min_burst_size: int = 16
    max_burst_size: int = 48
    burst_spread_s: float = 0.5
    min_gap_s: float = 2.0
    max_gap_s: float = 4.0
    num_trickle: int = 2

    def __post_init__(self) -> None:
        for name, is_ok in (("num_bursts", self.num_bursts >= 1), ("min_burst_size", self.min_burst_size >= 1),
                            ("max_burst_size", self.max_burst_size >= self.min_burst_size),
                            ("burst_spread_s", self.burst_spread_s >= 0), ("min_gap_s", self.min_gap_s >= 0),
                            ("max_gap_s", self.max_gap_s >= self.min_gap_s), ("num_trickle", self.num_trickle >= 0)):
            if not is_ok:
                raise ValueError(f"{name}: out of range, got {getattr(self, name)!r}")


def bursty_arrivals(cfg: BurstConfig, seed: int) -> list[float]:
    """Arrival offsets (seconds from the trace's start, sorted, first = 0.0) of ``cfg``'s trace;
    the same ``seed`` always gives the same list (``random.Random(seed)``, no global state)."""
    import random

    rng = random.Random(seed)
    arrivals: list[float] = []
    start = 0.0
    for burst in range(cfg.num_bursts):
        size = rng.randint(cfg.min_burst_size, cfg.max_burst_size)
        arrivals += [start + rng.uniform(0.0, cfg.burst_spread_s) for _ in range(size)]
        if burst == cfg.num_bursts - 1:
            break
        gap = rng.uniform(cfg.min_gap_s, cfg.max_gap_s)
        gap_start = start + cfg.burst_spread_s
        arrivals += [gap_start + gap * (i + 1) / (cfg.num_trickle + 1) for i in range(cfg.num_trickle)]
        start = gap_start + gap
    first = min(arrivals)
    return sorted(round(t - first, 6) for t in arrivals)
