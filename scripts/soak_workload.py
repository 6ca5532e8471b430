"""The soak's workload (``scripts/soak.py``): request plans, one request's stream, all of them.

A plan is drawn from a seeded RNG: its kind (greedy, seeded sampled, unseeded sampled, penalty,
n=2), sampling parameters, stop strings, and an abort point (client cancel or the Abort RPC after
a random number of chunks). ``run_one`` sends it (again while the gateway answers that it cannot
connect to the coordinator, as a client would) and returns its outcome: ``completed``,
``aborted``, ``failed`` (with the status code) or ``hung`` (the stream did not end within the
deadline), with its start/end times (``time.monotonic``) and every choice's token ids.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time

import grpc

from minedraft.client import AsyncMineDraftClient, GenerationError, build_request

PROMPTS = ["Why is the sky blue?", "Write a haiku about rain.", "List three prime numbers.",
           "Explain gravity in one sentence.", "What is the capital of France?", "Tell me a short story.",
           "How do airplanes fly?", "Give me a recipe for pancakes.", "What is 17 times 3?", "Name a color."]
STOP_STRINGS = (["\n\n"], ["."], [","], ["the", "and"], ["e"])
PENALTY_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
PENALTIES = ({"presence_penalty": 0.5}, {"frequency_penalty": 0.7}, {"repetition_penalty": 1.3},
             {"presence_penalty": -0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1})
KINDS = ("greedy", "seeded", "sampled", "penalty", "n2")
KIND_WEIGHTS = (35, 20, 10, 20, 15)


def request_plan(rng: random.Random, i: int, args) -> dict:
    """Kind, sampling parameters, choices and abort point of request ``i``."""
    kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
    sampling = {"max_tokens": rng.randint(args.min_tokens, args.max_tokens)}
    if kind == "greedy" or (kind in ("penalty", "n2") and rng.random() < 0.5):
        sampling["temperature"] = 0.0
    else:
        sampling.update(temperature=rng.choice([0.6, 0.8, 1.0]), top_p=rng.choice([1.0, 0.9]),
                        top_k=rng.choice([-1, 50]))
        if kind != "sampled":
            sampling["seed"] = rng.randrange(1 << 31)
    if kind == "penalty":
        sampling.update(rng.choice(PENALTIES))
    n, best_of = (2, 3 if rng.random() < 0.25 else 0) if kind == "n2" else (0, 0)
    if rng.random() < 0.25:
        sampling["stop"] = list(rng.choice(STOP_STRINGS))
    abort = None
    if rng.random() < args.abort_fraction:
        abort = ("cancel" if rng.random() < 0.5 else "rpc", rng.randint(0, max(sampling["max_tokens"] // 4, 1)))
    return {"request_id": f"soak-{i}", "kind": kind, "prompt": PROMPTS[i % len(PROMPTS)], "sampling": sampling,
            "n": n, "best_of": best_of, "abort": abort}


def is_greedy(plan: dict) -> bool:
    return plan["sampling"].get("temperature", 1.0) == 0.0


def greedy_key(plan: dict) -> str:
    """What a greedy output depends on besides max_tokens and stop strings: prompt and penalties."""
    penalties = ",".join(f"{k}={plan['sampling'][k]}" for k in PENALTY_KEYS if k in plan["sampling"])
    return f"{plan['prompt']}|{penalties}"


REFUSED = "failed to connect"  # gRPC's words when the connection is refused: the request reached no coordinator
RETRY_BACKOFF_S = 0.2


def is_refused(result: dict) -> bool:
    """UNAVAILABLE before any token because the gateway could not connect to the coordinator (it
    is down): safe to send again, as a client does; a stream cut in flight is not retried."""
    return (result["outcome"] == "failed" and result["code"] == "UNAVAILABLE" and result["num_chunks"] == 0
            and REFUSED in result["message"])


async def run_one(client: AsyncMineDraftClient, plan: dict, deadline_s: float, retry_refused: bool = True) -> dict:
    """Send one request (again, after ``RETRY_BACKOFF_S``, while it is refused and ``retry_refused``);
    its outcome, ``start``/``end`` (monotonic s), refusals retried, and the choices' outputs."""
    start, retries = time.monotonic(), 0
    while True:
        result = await _send(client, plan, max(deadline_s - (time.monotonic() - start), 0.01))
        if not (retry_refused and is_refused(result) and time.monotonic() - start < deadline_s):
            return {**result, "start": start, "end": time.monotonic(), "retries": retries}
        retries += 1
        await asyncio.sleep(RETRY_BACKOFF_S)


async def _send(client: AsyncMineDraftClient, plan: dict, deadline_s: float) -> dict:
    request = build_request(messages=[{"role": "user", "content": plan["prompt"]}], request_id=plan["request_id"],
                            n=plan["n"], best_of=plan["best_of"], **plan["sampling"])
    start, state = time.monotonic(), {"num_chunks": 0}
    try:
        async with contextlib.aclosing(client.stream(request)) as stream:  # leaving it cancels the call
            result = await asyncio.wait_for(_consume(client, plan, stream, start, state), deadline_s)
    except asyncio.TimeoutError:
        result = {"outcome": "hung", "message": f"stream not ended within {deadline_s:.0f} s"}
    except (grpc.RpcError, GenerationError) as exc:
        code = exc.code().name if isinstance(exc, grpc.RpcError) else grpc.StatusCode(_code(exc.code)).name
        message = exc.details() if isinstance(exc, grpc.RpcError) else exc.message
        result = {"outcome": "failed", "code": code, "message": str(message)[:300]}
    return {**result, "num_chunks": state["num_chunks"]}


async def _consume(client: AsyncMineDraftClient, plan: dict, stream, start: float, state: dict) -> dict:
    """Read ``stream`` until all n choices completed, aborting it per ``plan["abort"]``; counts
    chunks with tokens in ``state["num_chunks"]``."""
    num_choices, choices = max(plan["n"], 1), {}
    ttft, abort = None, plan["abort"]
    async for response in stream:
        kind = response.WhichOneof("response")
        if kind == "error":
            return {"outcome": "failed", "code": grpc.StatusCode(_code(response.error.code)).name,
                    "message": response.error.message[:300]}
        if kind == "complete":
            done = response.complete
            choices[done.index] = {"finish_reason": done.finish_reason, "token_ids": list(done.output_token_ids),
                                   "completion_tokens": done.usage.completion_tokens}
            if len(choices) == num_choices:
                reasons = [c["finish_reason"] for c in choices.values()]
                return {"outcome": "aborted" if "abort" in reasons else "completed", "ttft_s": ttft,
                        "latency_s": time.monotonic() - start,
                        "choices": [choices[i] for i in sorted(choices)]}
            continue
        if response.chunk.token_ids:
            ttft = ttft if ttft is not None else time.monotonic() - start
            state["num_chunks"] += 1
        if abort is not None and state["num_chunks"] >= abort[1]:
            if abort[0] == "cancel":
                return {"outcome": "aborted", "how": "cancel"}  # leaving the loop cancels the call
            await client.abort(plan["request_id"])
            abort = None  # the stream now ends with finish_reason "abort" (or a finish that won the race)
    return {"outcome": "failed", "code": "INTERNAL",
            "message": f"stream ended after {len(choices)} of {num_choices} completes"}


def _code(value: int) -> tuple:
    """grpc.StatusCode value tuple of an int code (``grpc.StatusCode(...)`` takes the tuple)."""
    return next(c.value for c in grpc.StatusCode if c.value[0] == value)


async def run_workload(address: str, plans: list[dict], args, done: list[int]) -> list[dict]:
    """All plans, ``args.concurrency`` at a time; ``done[0]`` counts the finished ones."""
    results: list[dict] = []
    limiter = asyncio.Semaphore(args.concurrency)
    async with AsyncMineDraftClient(address, timeout_s=args.deadline + 60) as client:
        async def one(plan: dict) -> None:
            async with limiter:
                outcome = await run_one(client, plan, args.deadline, not args.no_retry)
            results.append({**outcome, "request_id": plan["request_id"], "plan": plan})
            done[0] += 1

        await asyncio.gather(*(one(plan) for plan in plans))
    return results


async def greedy_reference(address: str, plans: list[dict], max_tokens: int, concurrency: int) -> dict[str, list[int]]:
    """Token ids of every greedy key of ``plans`` (``greedy_key``), ``max_tokens`` each, no stop
    strings: run once through an ``ar`` stack at ``address``."""
    keyed = {greedy_key(p): p for p in plans if is_greedy(p)}
    limiter, reference = asyncio.Semaphore(concurrency), {}
    async with AsyncMineDraftClient(address, timeout_s=600) as client:
        async def one(j: int, key: str, plan: dict) -> None:
            sampling = {k: v for k, v in plan["sampling"].items() if k in PENALTY_KEYS}
            async with limiter:
                result = await client.generate(messages=[{"role": "user", "content": plan["prompt"]}],
                                               request_id=f"ref-{j}",
                                               temperature=0.0, max_tokens=max_tokens, **sampling)
            reference[key] = result.token_ids

        await asyncio.gather(*(one(j, key, plan) for j, (key, plan) in enumerate(keyed.items())))
    return reference
