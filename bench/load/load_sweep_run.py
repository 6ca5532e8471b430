"""One load point of ``bench/load/load_sweep.py``: send requests through a gateway, then summarize.

Two kinds of point, both over gRPC (``minedraft.client.AsyncMineDraftClient``, streaming):

- closed loop at concurrency ``c``: ``num_requests`` requests, at most ``c`` in flight (a new one
  starts when one finishes);
- open loop: request ``i`` is sent at ``arrivals[i]`` seconds after the point's start whatever
  the service does (``bench.common.loadgen.bursty_arrivals``).

Request ``i`` of every point uses prompt ``i mod len(pool)`` of the Spec-Bench pool, so the same
point of two configurations sends the same prompts (greedy outputs compare by index). Metrics:
``minedraft.prompts.summarize`` (output tokens/s over the point's wall time, TTFT and end-to-end
latency p50/p99 in ms, mean acceptance length), plus, from the coordinator, the steps run inside
the point's time window (``--step-log``: steps per mode, k histogram, mean step/draft/verify ms)
and the ``--mode auto`` decisions counted by its Prometheus ``/metrics`` during the point.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

from bench.common.loadgen import Prompt, load_spec_bench
from minedraft.client import AsyncMineDraftClient, GenerationResult
from minedraft.prompts import summarize

AUTO_DECISIONS_METRIC = "minedraft:auto_mode_decisions_total"
SLOW_STEP_MS = 100.0  # a step this slow is a stall (first-use graph capture), not steady state
CLOSED_LOOP = "closed"
OPEN_LOOP = "open"


@dataclass(frozen=True)
class PointSpec:
    """A load point: ``kind`` closed (``concurrency``, ``num_requests``) or open (``arrivals`` in s)."""

    label: str
    kind: str
    num_requests: int
    concurrency: int = 0
    arrivals: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in (CLOSED_LOOP, OPEN_LOOP):
            raise ValueError(f"kind: must be {CLOSED_LOOP!r} or {OPEN_LOOP!r}, got {self.kind!r}")
        if self.num_requests < 1 or (self.kind == CLOSED_LOOP and self.concurrency < 1):
            raise ValueError(f"num_requests/concurrency: must be >= 1 ({self.label})")
        if self.kind == OPEN_LOOP and len(self.arrivals) != self.num_requests:
            raise ValueError(f"arrivals: {len(self.arrivals)} times for {self.num_requests} requests")


def closed_point(concurrency: int, requests_per_client: int, min_requests: int, max_requests: int = 0) -> PointSpec:
    """``max(min_requests, requests_per_client * concurrency)`` requests, capped by ``max_requests`` (0 = none)."""
    num_requests = max(min_requests, requests_per_client * concurrency)
    if max_requests:
        num_requests = max(min(num_requests, max_requests), 1)
    return PointSpec(f"c{concurrency}", CLOSED_LOOP, num_requests, concurrency)


def open_point(label: str, arrivals: list[float]) -> PointSpec:
    return PointSpec(label, OPEN_LOOP, len(arrivals), arrivals=tuple(arrivals))


def prompt_pool(path: str, max_prompts: int) -> list[Prompt]:
    """Up to ``max_prompts`` Spec-Bench first turns, round-robin over its tasks (``load_spec_bench``)."""
    with open(path, encoding="utf-8") as f:
        num_rows = sum(1 for line in f if line.strip())
    return load_spec_bench(path, min(max_prompts, num_rows))


async def _send(client: AsyncMineDraftClient, pool: list[Prompt], index: int, sampling: dict,
                request_prefix: str) -> GenerationResult:
    prompt = pool[index % len(pool)]
    return await client.generate(messages=[{"role": "user", "content": prompt.text}],
                                 request_id=f"{request_prefix}-r{index}-q{prompt.prompt_id}", **sampling)


async def _run_point(gateway: str, pool: list[Prompt], point: PointSpec, sampling: dict,
                     wait_s: float, request_prefix: str) -> tuple[list[GenerationResult], float]:
    async with AsyncMineDraftClient(gateway) as client:
        await client.wait_until_serving(wait_s)
        semaphore = asyncio.Semaphore(point.concurrency or point.num_requests)
        start = time.perf_counter()

        async def one(index: int) -> GenerationResult:
            if point.kind == OPEN_LOOP:
                await asyncio.sleep(max(0.0, start + point.arrivals[index] - time.perf_counter()))
            async with semaphore:
                return await _send(client, pool, index, dict(sampling, seed=sampling["seed"] + index), request_prefix)

        results = await asyncio.gather(*(one(i) for i in range(point.num_requests)))
        return list(results), time.perf_counter() - start


def scrape_counter(metrics_url: str, name: str = AUTO_DECISIONS_METRIC) -> dict[str, float]:
    """``{"mode=psd,reason=best_goodput": value}`` of a Prometheus counter; {} when unreachable."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels.replace('"', "")] = float(value)
    return out


def window_steps(step_log: str, start_s: float, end_s: float) -> dict:
    """Coordinator steps that started in ``[start_s, end_s]`` (Unix s): count per mode, k
    histogram (``{"k": steps}``), mean step wall / draft / verify ms, total step time (s) and the
    steps slower than ``SLOW_STEP_MS`` (count, seconds: on a GPU mostly first-use CUDA graph
    captures of a new batch/verify-width/KV shape, ``specdec.engine.cuda_graphs``); {} without steps."""
    try:
        with open(step_log, encoding="utf-8") as f:
            steps = [s for s in map(json.loads, filter(str.strip, f)) if start_s <= s["start_s"] <= end_s]
    except OSError:
        return {}
    if not steps:
        return {}
    means = {f"step_{key}_mean": sum(s[key] for s in steps) / len(steps) for key in ("wall_ms", "draft_ms", "verify_ms")}
    slow = [s["wall_ms"] for s in steps if s["wall_ms"] > SLOW_STEP_MS]
    return {"num_steps": len(steps), "num_slow_steps": len(slow), "slow_step_s": sum(slow) / 1e3,
            "step_s": sum(s["wall_ms"] for s in steps) / 1e3, "steps_by_mode": dict(Counter(s["mode"] for s in steps)),
            "steps_by_k": {str(k): n for k, n in sorted(Counter(s["k"] for s in steps).items())}, **means}


def run_point(gateway: str, pool: list[Prompt], point: PointSpec, sampling: dict, wait_s: float,
              step_log: str = "", metrics_url: str = "", request_prefix: str = "") -> tuple[dict, list[GenerationResult]]:
    """Runs ``point``; returns (metrics, per-request results in index order). Request ids are
    ``<request_prefix or point label>-r<index>-q<question id>``.

    Raises:
        TimeoutError: the gateway was not SERVING within ``wait_s``; grpc errors of a request.
    """
    before = scrape_counter(metrics_url) if metrics_url else {}
    start_unix = time.time()
    results, wall_s = asyncio.run(_run_point(gateway, pool, point, sampling, wait_s,
                                                   request_prefix or point.label))
    metrics = summarize(results, wall_s)
    metrics.update(kind=point.kind, concurrency=point.concurrency)
    metrics.update(window_steps(step_log, start_unix, time.time()) if step_log else {})
    if metrics_url:
        after = scrape_counter(metrics_url)
        decisions = {key: after[key] - before.get(key, 0.0) for key in after if after[key] > before.get(key, 0.0)}
        metrics["auto_decisions"] = decisions
    return metrics, results
