"""``minedraft prompts``: send Spec-Bench prompts through a running gateway and report metrics.

Input: a Spec-Bench / MT-bench style jsonl file (``{"question_id", "category", "turns": [...]}``);
the first turn of each of the first ``limit`` lines is sent as a one-message chat (``messages``,
rendered with the chat template by the gateway), ``concurrency`` requests at a time.

Metrics (``summarize``):
- ``output_tokens_per_s``: completion tokens of all requests / wall time of the run (tokens/s);
- ``requests_per_s``: finished requests / wall time;
- ``mean_acceptance_length``: ``1 + accepted / num_drafts`` (vLLM's definition: tokens committed
  per verify step that carried drafts; 1.0 without speculation), from each request's Usage;
- ``acceptance_rate``: accepted / drafted draft tokens;
- ``ttft_ms_p50/p99``: time to first token (ms); ``latency_ms_p50/p99``: end-to-end latency (ms).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass

from tqdm import tqdm

from minedraft.client import AsyncMineDraftClient, GenerationResult

DEFAULT_GATEWAY = "127.0.0.1:50051"


@dataclass(frozen=True)
class PromptsConfig:
    """Settings of one prompts run (see module docstring)."""

    path: str
    gateway: str = DEFAULT_GATEWAY
    limit: int = 32
    concurrency: int = 8
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    wait_s: float = 60.0
    api_key: str = ""   # for a gateway started with --api-key ("" = none)

    def __post_init__(self) -> None:
        for name, is_ok in (("limit", self.limit >= 1), ("concurrency", self.concurrency >= 1),
                            ("max_tokens", self.max_tokens >= 1), ("temperature", self.temperature >= 0),
                            ("wait_s", self.wait_s >= 0)):
            if not is_ok:
                raise ValueError(f"{name}: out of range, got {getattr(self, name)!r}")
        if not os.path.isfile(self.path):
            raise ValueError(f"path: no such file {self.path!r}")


def load_prompts(path: str, limit: int) -> list[tuple[str, str]]:
    """``(question_id, first turn)`` of the first ``limit`` rows of a Spec-Bench jsonl file.

    Raises:
        ValueError: a row has no ``turns``.
    """
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if not row.get("turns"):
                raise ValueError(f"{path}: row {row.get('question_id')} has no turns")
            prompts.append((str(row.get("question_id", len(prompts))), row["turns"][0]))
            if len(prompts) == limit:
                break
    return prompts


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: list[GenerationResult], wall_s: float) -> dict:
    """Aggregate metrics of a run (units in the key names; see module docstring)."""
    num_tokens = sum(r.usage.completion_tokens for r in results)
    drafted = sum(r.usage.num_draft_tokens for r in results)
    accepted = sum(r.usage.num_accepted_tokens for r in results)
    num_drafts = sum(r.usage.num_drafts for r in results)
    ttfts = [r.ttft_s * 1000 for r in results if not math.isnan(r.ttft_s)]
    latencies = [r.latency_s * 1000 for r in results if not math.isnan(r.latency_s)]
    return {
        "num_requests": len(results),
        "num_output_tokens": num_tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": num_tokens / wall_s if wall_s > 0 else math.nan,
        "requests_per_s": len(results) / wall_s if wall_s > 0 else math.nan,
        "mean_acceptance_length": 1.0 + accepted / num_drafts if num_drafts else 1.0,
        "acceptance_rate": accepted / drafted if drafted else math.nan,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
        "latency_ms_p50": percentile(latencies, 50), "latency_ms_p99": percentile(latencies, 99),
        "finish_reasons": {reason: sum(r.finish_reason == reason for r in results)
                           for reason in sorted({r.finish_reason for r in results})},
    }


async def _run_async(cfg: PromptsConfig, prompts: list[tuple[str, str]]) -> tuple[list[GenerationResult], float]:
    async with AsyncMineDraftClient(cfg.gateway, api_key=cfg.api_key) as client:
        if cfg.wait_s > 0:
            await client.wait_until_serving(cfg.wait_s)
        semaphore = asyncio.Semaphore(cfg.concurrency)
        progress = tqdm(total=len(prompts), desc="prompts", unit="req")

        async def one(index: int, question_id: str, text: str) -> GenerationResult:
            async with semaphore:
                sampling = dict(max_tokens=cfg.max_tokens, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
                if cfg.seed is not None:
                    sampling["seed"] = cfg.seed + index
                result = await client.generate(messages=[{"role": "user", "content": text}],
                                               request_id=f"q{question_id}-{index}", **sampling)
                progress.update(1)
                return result

        start = time.perf_counter()
        try:
            results = await asyncio.gather(*(one(i, qid, text) for i, (qid, text) in enumerate(prompts)))
        finally:
            progress.close()
        return list(results), time.perf_counter() - start


def run_prompts(cfg: PromptsConfig) -> tuple[dict, list[GenerationResult]]:
    """Runs the prompts; returns (metrics, per-request results in prompt order).

    Raises:
        TimeoutError: the gateway was not SERVING within ``wait_s``.
        grpc.RpcError / minedraft.client.GenerationError: a request failed.
    """
    prompts = load_prompts(cfg.path, cfg.limit)
    results, wall_s = asyncio.run(_run_async(cfg, prompts))
    return summarize(results, wall_s), results


def format_metrics(metrics: dict) -> str:
    """Human-readable lines of ``summarize``'s output."""
    return "\n".join(f"{key:>24}: {'-' if math.isnan(value) else f'{value:.3f}'}" if isinstance(value, float)
                     else f"{key:>24}: {value}" for key, value in metrics.items())


def _strict(value):
    """``value`` with every NaN float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


def write_json(path: str, payload) -> None:
    """Writes ``payload`` as indented strict JSON (NaN -> null), creating parent directories."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_strict(payload), f, indent=2, allow_nan=False)
        f.write("\n")


def results_as_records(results: list[GenerationResult]) -> list[dict]:
    """Per-request outputs for ``--outputs`` (text, token ids, finish reason, usage)."""
    return [{"request_id": r.request_id, "text": r.text, "token_ids": r.token_ids,
             "finish_reason": r.finish_reason, "completion_tokens": r.usage.completion_tokens,
             "num_accepted_tokens": r.usage.num_accepted_tokens, "num_drafts": r.usage.num_drafts}
            for r in results]
