"""``python -m bench.engines.rpc_floor``: the floor of one Verify RPC on this host, to set against the
transport that the stack's step log reports ("RPC: service / transport (request + response)").

A minimal ``Verifier`` servicer (no engine: it answers each call at once with 32 tokens and their
logprobs per row, as a 32-step ``ar`` call does) runs in a child process, on ``grpc.aio`` as the
services do; a ``grpc.aio`` client in this process calls it ``--num-calls`` times back to back with
``--rows`` request ids, unary ``Verify`` and ``VerifyStream`` (``--partials`` partial messages,
then the whole response). Per call, on the host's one clock (the server reports its handler's
start, as ``VerifyResponse.service_start_s`` does in the services):

- ``request_ms``: from the client's send to the handler's start;
- ``response_ms``: from the handler's start to the client's receipt of the last message
  (the handler itself does nothing, so this is serialization, transport and the client's wakeup);
- ``rpc_ms``: the whole call.

``--server-imports torch,vllm`` imports those modules in the server first (a process that holds
an engine's libraries and threads, as the verifier does). Medians (ms) as JSON to stdout and
``--out``. Example (the device host, then this CPU)::

    python -m bench.engines.rpc_floor --num-calls 2000 --server-imports torch,vllm --out /tmp/rpc_floor.json
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import grpc

from minedraft.probes import free_loopback_ports
from minedraft.v1 import engine_pb2, engine_pb2_grpc

TOKENS_PER_ROW = 32


class FloorVerifier(engine_pb2_grpc.VerifierServicer):
    """Answers at once; ``partials`` partial messages before a streamed call's whole response."""

    def __init__(self, partials: int) -> None:
        self.partials = partials

    @staticmethod
    def _whole(request, start_s: float) -> engine_pb2.VerifyResponse:
        return engine_pb2.VerifyResponse(step_id=request.step_id, service_start_s=start_s, outputs=[
            engine_pb2.SeqOutput(request_id=rid, token_ids=range(TOKENS_PER_ROW), logprobs=[-0.5] * TOKENS_PER_ROW)
            for rid in request.request_ids])

    async def Verify(self, request, context):
        return self._whole(request, time.time())

    async def VerifyStream(self, request, context):
        start_s = time.time()
        per_partial = TOKENS_PER_ROW // max(self.partials + 1, 1)
        for _ in range(self.partials):
            yield engine_pb2.VerifyResponse(step_id=request.step_id, is_partial=True, outputs=[
                engine_pb2.SeqOutput(request_id=rid, token_ids=range(per_partial)) for rid in request.request_ids])
        yield self._whole(request, start_s)


async def _serve(port: int, partials: int) -> None:
    server = grpc.aio.server()
    engine_pb2_grpc.add_VerifierServicer_to_server(FloorVerifier(partials), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def measure(address: str, num_calls: int, rows: int, stream: bool, num_warmup: int = 50) -> dict:
    """Medians (ms) of ``num_calls`` back-to-back calls (after ``num_warmup``) against ``address``."""
    parts: dict[str, list[float]] = {"request_ms": [], "response_ms": [], "rpc_ms": []}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.VerifierStub(channel)
        request = engine_pb2.VerifyRequest(request_ids=[f"r{i}" for i in range(rows)], num_decode_steps=TOKENS_PER_ROW)
        for i in range(num_warmup + num_calls):
            request.step_id = i + 1
            sent_s, start = time.time(), time.perf_counter()
            if stream:
                async for response in stub.VerifyStream(request):
                    if not response.is_partial:
                        break
            else:
                response = await stub.Verify(request)
            rpc_ms = (time.perf_counter() - start) * 1e3
            if i >= num_warmup:
                request_ms = (response.service_start_s - sent_s) * 1e3
                parts["request_ms"].append(request_ms)
                parts["response_ms"].append(rpc_ms - request_ms)
                parts["rpc_ms"].append(rpc_ms)
    return {key: round(statistics.median(values), 4) for key, values in parts.items()}


def _start_server(partials: int, imports: str) -> tuple[subprocess.Popen, int]:
    port = free_loopback_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "bench.engines.rpc_floor", "--serve", str(port), "--partials",
                             str(partials), "--server-imports", imports], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the floor server did not start (exit {proc.wait()})")
    return proc, port


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engines.rpc_floor", description=__doc__.split("\n")[0])
    p.add_argument("--num-calls", type=int, default=1000)
    p.add_argument("--rows", type=int, default=16, help="request ids per call (32 tokens each in the response)")
    p.add_argument("--partials", type=int, default=3, help="VerifyStream: partial messages before the whole")
    p.add_argument("--server-imports", default="", help="comma-separated modules the server imports first")
    p.add_argument("--out", default="")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.num_calls < 1 or args.rows < 1 or args.partials < 0:
        p.error("--num-calls and --rows must be >= 1, --partials >= 0")
    if args.serve:
        for name in filter(None, args.server_imports.split(",")):
            importlib.import_module(name)
        asyncio.run(_serve(args.serve, args.partials))
        return 0
    proc, port = _start_server(args.partials, args.server_imports)
    try:
        address = f"127.0.0.1:{port}"
        result = {"rows": args.rows, "partials": args.partials, "server_imports": args.server_imports,
                  "num_calls": args.num_calls, "cpus": len(os.sched_getaffinity(0)),
                  "unary": asyncio.run(measure(address, args.num_calls, args.rows, stream=False)),
                  "stream": asyncio.run(measure(address, args.num_calls, args.rows, stream=True))}
    finally:
        proc.kill()
        proc.wait()
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
