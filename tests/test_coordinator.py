"""Coordinator step loop against in-process fake engines (tests/coordinator_harness.py):
greedy outputs equal the toy reference in every mode, sampled draft probs, the draft window,
and ``python -m coordinator`` as a process. Faults: test_coordinator_faults.py; config and
tensor helpers: test_coordinator_config.py.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import urllib.request

import pytest

from coordinator.server import SERVICE_NAME
from coordinator_harness import (  # noqa: F401  (VOCAB, toy_next, wait_until: re-exported for other tests)
    VOCAB,
    FakeDrafter,
    FakeVerifier,
    Harness,
    _expected,
    _serve,
    _workload,
    toy_next,
    wait_until,
)
from minedraft.probes import free_loopback_ports
from minedraft.serving import aio_channel, wait_for_serving
from minedraft.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, engine_pb2_grpc


@pytest.mark.parametrize("mode", ["ar", "sd", "psd"])
def test_greedy_output_equals_reference_in_every_mode(mode: str) -> None:
    max_num_seqs, work = 3, _workload(14)  # > 2m requests: batches fill, requests finish and get replaced

    async def main():
        async with Harness(mode=mode, max_num_seqs=max_num_seqs, num_speculative_tokens=3) as h:
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, usage) in zip(work, results):
                assert tokens == _expected(prompt, sampling), rid
                assert reason in ("stop", "length") and usage.completion_tokens == len(tokens)
                assert usage.num_accepted_tokens <= usage.num_draft_tokens
            await asyncio.sleep(0.05)
            status = await h.stub.GetStatus(coordinator_pb2.StatusRequest())
            assert status.num_running == 0 and not h.verifier.committed and not h.drafter.known
            assert h.verifier.max_slots_used == (2 * max_num_seqs if mode == "psd" else max_num_seqs)
            assert h.num_checked_steps == status.num_steps > 0
            if mode == "ar":
                assert h.drafter.num_draft_calls == 0 and status.num_draft_tokens == 0
            else:
                assert status.num_accepted_tokens > 0 and status.num_draft_tokens > status.num_accepted_tokens
            assert (status.num_parallel_steps > status.num_steps // 2) if mode == "psd" else status.num_parallel_steps == 0
            metric = h.scheduler.metrics.registry.get_sample_value
            assert metric("minedraft:spec_decode_num_draft_tokens_total") == status.num_draft_tokens
            assert metric("minedraft:spec_decode_num_accepted_tokens_total") == status.num_accepted_tokens
            if mode != "ar":
                per_pos = [metric("minedraft:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(p)}) for p in range(3)]
                assert sum(per_pos) == status.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)

    asyncio.run(main())


@pytest.mark.parametrize("data_plane", ["inline", "dist"])
def test_sampled_draft_probs_follow_their_requests(data_plane: str) -> None:
    async def main():
        async with Harness(mode="psd", max_num_seqs=2, data_plane=data_plane) as h:
            work = _workload(6)
            results = await asyncio.gather(*(h.generate(rid, p, temperature=0.8, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, _, _) in zip(work, results):
                assert tokens == _expected(prompt, sampling)
            if data_plane == "inline":
                assert h.verifier.num_prob_rows > 0 and h.verifier.num_dist_fetches == 0
            else:
                assert h.verifier.num_dist_fetches > 0 and h.verifier.num_prob_rows == 0

    asyncio.run(main())


def _free_port() -> int:
    return free_loopback_ports(1)[0]   # below the ephemeral range (minedraft.probes)


def test_main_serves_health_after_engines_and_drains_on_sigterm() -> None:
    """``python -m coordinator`` against the fake engines: health SERVING, a request, SIGTERM exit 0."""

    async def main():
        verifier = FakeVerifier(0.002)
        drafter = FakeDrafter(verifier, 0.7, 0.002)
        verifier.committed["one"], drafter.known["one"] = [1, 2], [1]  # left over by an earlier coordinator
        servers = [await _serve(engine_pb2_grpc.add_VerifierServicer_to_server, verifier, "minedraft.v1.Verifier"),
                   await _serve(engine_pb2_grpc.add_DrafterServicer_to_server, drafter, "minedraft.v1.Drafter")]
        port, metrics_port = _free_port(), _free_port()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator", "--mode", "psd", "--k", "2", "--max-num-seqs", "2",
            "--verifier", servers[0][1], "--drafter", servers[1][1], "--port", str(port), "--engine-wait", "30",
            "--metrics-port", str(metrics_port))
        try:
            await wait_for_serving(f"127.0.0.1:{port}", timeout_s=60, service=SERVICE_NAME)
            async with aio_channel(f"127.0.0.1:{port}") as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                call = stub.Generate(coordinator_pb2.CoordinatorGenerateRequest(
                    request_id="one", prompt_token_ids=[3, 4], sampling=common_pb2.SamplingParams(max_tokens=9)))
                tokens = [t async for r in call if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
                assert tokens == _expected([3, 4], {"max_tokens": 9})
                status = await stub.GetStatus(coordinator_pb2.StatusRequest())
                assert status.mode == "psd" and status.num_speculative_tokens == 2 and status.max_num_running == 4
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            body = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())).decode()
            assert f"minedraft:spec_decode_num_draft_tokens_total {float(status.num_draft_tokens)}" in body
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), timeout=30) == 0
        finally:
            if process.returncode is None:
                process.kill()
            for server, _ in servers:
                await server.stop(None)

    asyncio.run(main())


def test_requests_without_room_for_drafts_run_without_speculation_alone() -> None:
    """Draft window 12 tokens: a 14-token prompt never reaches the drafter, a short request stops
    speculating once committed + k - 1 > 12; outputs stay exact and the drafter stays in use."""
    from coordinator.context_window import ContextLimits

    async def main():
        async with Harness(mode="psd", max_num_seqs=2, num_speculative_tokens=3) as h:
            h.scheduler.limits = ContextLimits(verifier_max_model_len=0, drafter_max_model_len=12)
            work = [("long", list(range(3, 17)), {"max_tokens": 10}), ("short", [3, 4], {"max_tokens": 20}),
                    ("other", [5, 6], {"max_tokens": 6})]
            results = await asyncio.gather(*(h.generate(rid, p, **s) for rid, p, s in work))
            for (rid, prompt, sampling), (tokens, reason, _) in zip(work, results):
                assert reason in ("stop", "length") and tokens == _expected(prompt, sampling), rid
            assert "long" not in h.drafter.last_drafts
            num_known, drafts = h.drafter.last_drafts["short"]
            assert num_known + len(drafts) - 1 <= 12
            assert h.scheduler.is_drafter_available and h.scheduler.totals.num_draft_tokens > 0

    asyncio.run(main())
