"""Soak test: a bounded, mixed workload against a local MineDraft stack it starts itself.

    python scripts/soak.py --num-requests 2000 --concurrency 64 --abort-fraction 0.2 --out runs/soak.json
    python scripts/soak.py --tiny --num-requests 300 --concurrency 32       # tiny random models, fast

Starts verifier, drafter, coordinator and gateway (``minedraft.launcher.Stack``; the real
SmolLM2-135M-Instruct target and the default draft, or ``--tiny`` random Llamas with the SmolLM2
tokenizer) on free loopback ports, then sends ``--num-requests`` chat requests, ``--concurrency``
at a time, with mixed parameters drawn from a seeded RNG: greedy or sampled (temperature, top-p,
top-k, with or without a seed), stop strings, ``max_tokens`` in ``--min-tokens..--max-tokens``.
A fraction ``--abort-fraction`` is aborted at a random point (client cancel after a random number
of chunks, or the Abort RPC). When ``--kill-at`` of the requests are done, the drafter is killed
with SIGKILL and restarted on the same port (the coordinator continues in ``ar`` meanwhile and
resumes speculation when it is back). After the drain it reports completed, aborted and failed
counts (failures by status code), KV slots still in use in drafter and verifier (``GetInfo``;
must be 0), TTFT and latency p50/p99 of completed requests, and writes it all as JSON.
Exit status 0 only when nothing failed and no slot is left in use.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

import grpc

from minedraft.client import AsyncMineDraftClient, GenerationError, build_request
from minedraft.launcher import Stack, resolve_model_dir
from minedraft.stack import StackConfig, free_loopback_ports as free_ports
from minedraft.v1 import coordinator_pb2, coordinator_pb2_grpc, engine_pb2, engine_pb2_grpc

PROMPTS = ["Why is the sky blue?", "Write a haiku about rain.", "List three prime numbers.",
           "Explain gravity in one sentence.", "What is the capital of France?", "Tell me a short story.",
           "How do airplanes fly?", "Give me a recipe for pancakes.", "What is 17 times 3?", "Name a color."]
STOP_STRINGS = (["\n\n"], ["."], [","], ["the", "and"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--abort-fraction", type=float, default=0.2, help="share of requests aborted mid-stream")
    p.add_argument("--kill-at", type=float, default=0.5, help="kill (and restart) the drafter when this share "
                                                            "of requests is done; negative = never")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mode", choices=["ar", "sd", "psd"], default="psd")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="tiny random target and draft instead of SmolLM2")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's RNG")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it counts as failed")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--out", default="runs/soak.json")
    a = p.parse_args(argv)
    if a.num_requests < 1 or a.concurrency < 1 or not 0 <= a.abort_fraction <= 1 or not 1 <= a.min_tokens <= a.max_tokens:
        p.error("need num_requests >= 1, concurrency >= 1, abort_fraction in [0, 1], 1 <= min_tokens <= max_tokens")
    return a


def build_tiny_models(work_dir: str) -> tuple[str, str]:
    """(target_dir, draft_dir): random Llamas (2 and 1 layers) with the SmolLM2 tokenizer."""
    from specdec.models.gguf import packaged_gguf_path
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                              gguf_file=os.path.basename(packaged_gguf_path()))
    dirs = []
    for name, seed, num_layers in (("target", 0, 2), ("draft", 1, 1)):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
        path = os.path.join(work_dir, name)
        LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


def stack_config(args: argparse.Namespace, target: str, draft: str) -> StackConfig:
    gateway, coordinator, drafter, verifier, dist = free_ports(5)
    return StackConfig(mode=args.mode, num_speculative_tokens=args.k, max_num_seqs=args.max_num_seqs,
                       target=target, draft=draft, max_model_len=512 if args.tiny else 2048,
                       gateway_port=gateway, coordinator_port=coordinator, drafter_port=drafter,
                       verifier_port=verifier, dist_port=dist, runs_dir=args.runs_dir)


def request_plan(rng: random.Random, i: int, args: argparse.Namespace) -> dict:
    """Sampling parameters and abort point of request ``i``."""
    sampling = {"max_tokens": rng.randint(args.min_tokens, args.max_tokens)}
    if rng.random() < 0.5:
        sampling["temperature"] = 0.0
    else:
        sampling.update(temperature=rng.choice([0.6, 0.8, 1.0]), top_p=rng.choice([1.0, 0.9]),
                        top_k=rng.choice([-1, 50]))
        if rng.random() < 0.5:
            sampling["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.3:
        sampling["stop"] = rng.choice(STOP_STRINGS)
    abort = None
    if rng.random() < args.abort_fraction:
        abort = ("cancel" if rng.random() < 0.5 else "rpc", rng.randint(0, max(sampling["max_tokens"] // 4, 1)))
    return {"request_id": f"soak-{i}", "prompt": PROMPTS[i % len(PROMPTS)], "sampling": sampling, "abort": abort}


async def run_one(client: AsyncMineDraftClient, plan: dict) -> dict:
    """Send one request; returns its outcome: completed / aborted / failed (+ code), timings.
    Status codes: ``GenerationError.code`` / ``GenerateError.code`` are ints, mapped to names."""
    request = build_request(messages=[{"role": "user", "content": plan["prompt"]}],
                            request_id=plan["request_id"], **plan["sampling"])
    start = time.perf_counter()
    try:
        async with contextlib.aclosing(client.stream(request)) as stream:  # leaving it cancels the call
            return await _consume(client, plan, stream, start)
    except (grpc.RpcError, GenerationError) as exc:
        code = exc.code().name if isinstance(exc, grpc.RpcError) else grpc.StatusCode(_code(exc.code)).name
        return {"outcome": "failed", "code": code, "message": str(exc)[:200]}


async def _consume(client: AsyncMineDraftClient, plan: dict, stream, start: float) -> dict:
    """Read ``stream`` to its end, aborting it per ``plan["abort"]`` (cancel or Abort RPC)."""
    ttft, num_chunks, abort = None, 0, plan["abort"]
    async for response in stream:
        kind = response.WhichOneof("response")
        if kind == "error":
            return {"outcome": "failed", "code": grpc.StatusCode(_code(response.error.code)).name,
                    "message": response.error.message}
        if kind == "complete":
            reason = response.complete.finish_reason
            outcome = "aborted" if reason == "abort" else "completed"
            return {"outcome": outcome, "finish_reason": reason, "ttft_s": ttft,
                    "latency_s": time.perf_counter() - start,
                    "completion_tokens": response.complete.usage.completion_tokens}
        if response.chunk.token_ids:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            num_chunks += 1
        if abort is not None and num_chunks >= abort[1]:
            if abort[0] == "cancel":
                return {"outcome": "aborted", "how": "cancel"}  # leaving the loop cancels the call
            await client.abort(plan["request_id"])
            abort = None  # the stream now ends with finish_reason "abort" (or a finish that won the race)
    return {"outcome": "failed", "code": "INTERNAL", "message": "stream ended without complete"}


def _code(value: int) -> tuple:
    """grpc.StatusCode value tuple of an int code (``grpc.StatusCode(...)`` takes the tuple)."""
    return next(c.value for c in grpc.StatusCode if c.value[0] == value)


async def run_workload(stack: Stack, args: argparse.Namespace, kill_due: threading.Event) -> list[dict]:
    """All requests, ``concurrency`` at a time; sets ``kill_due`` when ``kill_at`` of them are done."""
    rng = random.Random(args.seed)
    plans = [request_plan(rng, i, args) for i in range(args.num_requests)]
    results: list[dict] = []
    kill_at = int(args.kill_at * args.num_requests) if args.kill_at >= 0 and stack.cfg.has_drafter else None
    limiter = asyncio.Semaphore(args.concurrency)
    address = f"{stack.cfg.host}:{stack.cfg.gateway_port}"
    async with AsyncMineDraftClient(address, timeout_s=args.timeout) as client:
        async def one(plan: dict) -> None:
            async with limiter:
                outcome = await run_one(client, plan)
            results.append({**outcome, "request_id": plan["request_id"], "sampling": plan["sampling"]})
            if kill_at is not None and len(results) >= kill_at:
                kill_due.set()

        await asyncio.gather(*(one(plan) for plan in plans))
    return results


def run_with_drafter_kill(stack: Stack, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """The workload in a thread of its own; the drafter is killed and restarted from *this* thread
    (children die with the thread that spawned them: PR_SET_PDEATHSIG, see minedraft.launcher)."""
    kill_due, outcome, record = threading.Event(), {}, {}

    def workload() -> None:
        try:
            outcome["results"] = asyncio.run(run_workload(stack, args, kill_due))
        finally:
            kill_due.set()  # also wakes the main thread when the workload ends first (or fails)

    thread = threading.Thread(target=workload, name="soak-workload")
    thread.start()
    kill_due.wait()
    if thread.is_alive() and args.kill_at >= 0 and stack.cfg.has_drafter:
        record["killed_pid"] = stack.kill("drafter")
        killed_at = time.monotonic()
        record["num_done_at_kill"] = int(args.kill_at * args.num_requests)
        stack.restart("drafter", log=lambda line: None)
        record["restarted_after_s"] = round(time.monotonic() - killed_at, 2)
    thread.join()
    if "results" not in outcome:
        raise RuntimeError("the workload failed; see the traceback above")
    return outcome["results"], record


def engine_slots_in_use(cfg: StackConfig, timeout_s: float = 60.0) -> dict:
    """KV slots still held per engine once the coordinator is idle (waits up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    engines = [("verifier", engine_pb2_grpc.VerifierStub, cfg.verifier_port)]
    if cfg.has_drafter:
        engines.append(("drafter", engine_pb2_grpc.DrafterStub, cfg.drafter_port))
    while True:
        in_use = {}
        for name, stub_cls, port in engines:
            with grpc.insecure_channel(f"{cfg.host}:{port}") as channel:
                info = stub_cls(channel).GetInfo(engine_pb2.EngineInfoRequest(), timeout=30)
            in_use[name] = max(info.max_num_seqs - info.num_free_slots, len(info.request_ids))
        if not any(in_use.values()) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.5)


def coordinator_status(cfg: StackConfig) -> coordinator_pb2.StatusResponse:
    with grpc.insecure_channel(f"{cfg.host}:{cfg.coordinator_port}") as channel:
        return coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(coordinator_pb2.StatusRequest(), timeout=30)


def percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1e3, 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3, 1)


def summarize(results: list[dict], kill: dict, slots: dict, status, wall_s: float, args) -> dict:
    counts = collections.Counter(r["outcome"] for r in results)
    completed = [r for r in results if r["outcome"] == "completed"]
    latencies = [r["latency_s"] for r in completed]
    ttfts = [r["ttft_s"] for r in completed if r["ttft_s"] is not None]
    return {
        "args": vars(args), "wall_s": round(wall_s, 1),
        "num_requests": len(results), "completed": counts["completed"], "aborted": counts["aborted"],
        "failed": counts["failed"],
        "failed_by_code": dict(collections.Counter(r["code"] for r in results if r["outcome"] == "failed")),
        "finish_reasons": dict(collections.Counter(r.get("finish_reason", "cancel") for r in results
                                                   if r["outcome"] != "failed")),
        "completion_tokens": sum(r["completion_tokens"] for r in completed),
        "latency_ms": {"p50": percentile_ms(latencies, 50), "p99": percentile_ms(latencies, 99)},
        "ttft_ms": {"p50": percentile_ms(ttfts, 50), "p99": percentile_ms(ttfts, 99)},
        "slots_in_use_after_drain": slots,
        "drafter_kill": kill,
        "coordinator": {"is_drafter_available": status.is_drafter_available, "effective_mode": status.effective_mode,
                        "num_steps": status.num_steps, "num_draft_tokens": status.num_draft_tokens,
                        "num_accepted_tokens": status.num_accepted_tokens,
                        "num_running": status.num_running, "num_waiting": status.num_waiting},
        "failures": [r for r in results if r["outcome"] == "failed"][:20],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="minedraft-soak-") as work_dir:
        if args.tiny:
            target, draft = build_tiny_models(work_dir)
            model_dir = target
        else:
            target, draft = "smollm2-135m-instruct", ""
            model_dir = resolve_model_dir(target)
        with Stack(stack_config(args, target, draft)) as stack:
            stack.start(model_dir)
            start = time.perf_counter()
            results, kill = run_with_drafter_kill(stack, args)
            wall_s = time.perf_counter() - start
            slots = engine_slots_in_use(stack.cfg)
            summary = summarize(results, kill, slots, coordinator_status(stack.cfg), wall_s, args)
            summary["run_dir"] = stack.run_dir
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("args", "failures")}, indent=2))
    return 0 if summary["failed"] == 0 and not any(slots.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
