"""``python -m bench.common.api_latency``: what the gateway's APIs add to a request, one at a time.

Against a running stack (``minedraft up``), sequentially (concurrency 1): ``GET /v1/models``
(no engine work: the HTTP server's own round trip), streaming ``/v1/completions`` and
``/v1/chat/completions`` (TTFT: until the first event carrying text; total), and the gRPC
``MineDraft.Generate`` stream with the same prompt (TTFT: until the first chunk). HTTP TTFT minus
gRPC TTFT is what the HTTP layer adds. Medians in ms, written to ``--out`` (JSON).

    python -m bench.common.api_latency --http http://127.0.0.1:8080/v1 --grpc 127.0.0.1:8000 --out /tmp/lat.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.common.api_latency")
    p.add_argument("--http", required=True, help="the OpenAI API base URL, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--grpc", required=True, help="the gateway's gRPC address, e.g. 127.0.0.1:8000")
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


async def _stream_ttft(create, **kwargs) -> tuple[float, float]:
    """(ms to the first event carrying text, ms to the end) of one streaming OpenAI call (the
    async client, as ``bench.common.loadgen`` uses)."""
    t0, first = time.perf_counter(), float("nan")
    async for event in await create(stream=True, **kwargs):
        choice = event.choices[0] if event.choices else None
        text = choice and (getattr(choice, "text", None) or (getattr(choice, "delta", None) and choice.delta.content))
        if text and first != first:
            first = (time.perf_counter() - t0) * 1e3
    return first, (time.perf_counter() - t0) * 1e3


def _grpc_ttft(stub, prompt: str, max_tokens: int) -> tuple[float, float]:
    from minedraft.v1 import common_pb2, generate_pb2

    request = generate_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, logprobs=-1))
    t0, first = time.perf_counter(), float("nan")
    for response in stub.Generate(request):
        if first != first and response.WhichOneof("response") == "chunk":
            first = (time.perf_counter() - t0) * 1e3
    return first, (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    import asyncio

    medians = asyncio.run(_measure(a))
    result = {"http": a.http, "grpc": a.grpc, "num_requests": a.num_requests, "max_tokens": a.max_tokens,
              "median": medians}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(medians))
    return 0


async def _measure(a) -> dict[str, float]:
    import grpc
    import openai

    from minedraft.v1 import generate_pb2_grpc

    stub = generate_pb2_grpc.MineDraftStub(grpc.insecure_channel(a.grpc))
    client = openai.AsyncOpenAI(base_url=a.http, api_key="unused")
    model = (await client.models.list()).data[0].id
    common = {"model": model, "max_tokens": a.max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
    calls = {
        "http_completions": lambda p: _stream_ttft(client.completions.create, prompt=p, **common),
        "http_chat": lambda p: _stream_ttft(client.chat.completions.create,
                                            messages=[{"role": "user", "content": p}], **common),
    }
    samples: dict[str, list[float]] = {"http_models_ms": []}
    for i in range(a.num_requests + 2):   # the first two warm connections and caches up
        prompt = f"Tell me about item {i} and more"
        t0 = time.perf_counter()
        await client.models.list()
        models_ms = (time.perf_counter() - t0) * 1e3
        measured = {name: await call(prompt) for name, call in calls.items()}
        measured["grpc_generate"] = _grpc_ttft(stub, prompt, a.max_tokens)
        if i < 2:
            continue
        samples["http_models_ms"].append(models_ms)
        for name, (first, total) in measured.items():
            samples.setdefault(f"{name}_ttft_ms", []).append(first)
            samples.setdefault(f"{name}_total_ms", []).append(total)
    return {name: round(statistics.median(values), 2) for name, values in samples.items()}


if __name__ == "__main__":
    raise SystemExit(main())
