"""A fake coordinator for the gateway tests (test_gateway*.py, test_http_api.py).

The fake coordinator (grpc.aio, in a thread of the test process) replays a scripted list of token
chunks per request, records aborts, and lets the test flip its health.
"""
from __future__ import annotations

import asyncio
import random
import subprocess
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.probes import free_loopback_ports
from minedraft.serving import ServerOptions, build_server
from minedraft.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

MAX_MODEL_LEN = 64
MODEL_NAME = "tiny-test-model"
STARTUP_TIMEOUT_S = 120.0


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Replays ``script`` (list of token-id lists, one per step) for every request.

    With ``is_seeded_sampling`` a sampled request (temperature > 0) gets tokens and logprobs that
    depend on its seed (``seeded_step``), as a sampler would; ``error_ids`` get ``error`` at once.
    """

    def __init__(self) -> None:
        self.script: list[list[int]] = []
        self.step_delay_s = 0.0
        self.abort_delay_s = 0.0  # an Abort answers after this long (an abort still landing)
        self.requests: list[coordinator_pb2.CoordinatorGenerateRequest] = []
        self.aborted: list[str] = []
        self.num_output_tokens: dict[str, int] = {}  # AbortRequest.num_output_tokens by request id
        self.error: common_pb2.GenerateError | None = None
        self.error_ids: set[str] = set()
        self.is_seeded_sampling = False
        self.break_after_steps: int | None = None  # the stream breaks (UNAVAILABLE) after this many chunks

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.error is not None or request.request_id in self.error_ids:
            error = self.error or common_pb2.GenerateError(code=grpc.StatusCode.INTERNAL.value[0], message="child failed")
            yield coordinator_pb2.CoordinatorGenerateResponse(error=error)
            return
        num_emitted = 0
        for step, ids in enumerate(self.script):
            if step == self.break_after_steps:  # as a coordinator killed in flight looks to its client
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")
            if request.request_id in self.aborted:
                yield coordinator_pb2.CoordinatorGenerateResponse(finished=coordinator_pb2.Finished(finish_reason="abort"))
                return
            await asyncio.sleep(self.step_delay_s)
            drafted = 0 if step == 0 else 3
            ids, logprob = seeded_step(request.sampling, step, ids) if self.is_seeded_sampling else (ids, -0.5)
            yield coordinator_pb2.CoordinatorGenerateResponse(chunk=coordinator_pb2.TokenChunk(
                token_ids=ids, logprobs=[logprob] * len(ids), num_draft_tokens=drafted,
                num_accepted_tokens=len(ids) - 1 if drafted else 0))
            num_emitted += len(ids)
        usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_emitted,
                                 num_draft_tokens=3 * (len(self.script) - 1),
                                 num_accepted_tokens=num_emitted - len(self.script))
        yield coordinator_pb2.CoordinatorGenerateResponse(
            finished=coordinator_pb2.Finished(finish_reason="length", usage=usage))

    async def Abort(self, request, context):
        await asyncio.sleep(self.abort_delay_s)
        self.aborted.append(request.request_id)
        if request.HasField("num_output_tokens"):
            self.num_output_tokens[request.request_id] = request.num_output_tokens
        return common_pb2.AbortResponse(found=True)

    async def GetStatus(self, request, context):
        return coordinator_pb2.StatusResponse(mode="psd")


def seeded_step(sampling: common_pb2.SamplingParams, step: int, ids: list[int]) -> tuple[list[int], float]:
    """(token ids, logprob of each) of one step of a sampled request: a function of its seed (random
    without one), e.g. seed 7 -> logprob -0.3; greedy requests keep ``ids`` and -0.5."""
    if sampling.temperature == 0:
        return ids, -0.5
    seed = sampling.seed if sampling.HasField("seed") else random.randrange(2**31)
    return [(t + 97 * seed + step) % 20000 + 1000 for t in ids], -0.1 * (1 + seed % 5)


class FakeCoordinatorThread:
    """Runs the fake coordinator's grpc.aio server in a background event loop."""

    def __init__(self) -> None:
        self.servicer = FakeCoordinator()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server, self.health, self.port = self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self):
        server, health, port = await build_server(["minedraft.v1.Coordinator"], ServerOptions(port=0))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self.servicer, server)
        await server.start()
        return server, health, port

    def set_serving(self) -> None:
        self._call(self.health.set_serving())

    def stop(self) -> None:
        self._call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)


def _free_port() -> int:
    return free_loopback_ports(1)[0]   # below the ephemeral range (minedraft.probes)


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _wait_until_up(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            _health(port)
            return
        except grpc.RpcError:
            time.sleep(0.2)
    raise TimeoutError("gateway did not start")
