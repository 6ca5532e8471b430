"""``python -m coordinator``: the MineDraft coordinator (request lifecycle, Batch Manager, step loop).

Serves ``minedraft.v1.Coordinator`` plus grpc.health.v1 (NOT_SERVING until both engines serve)
and reflection on ``--port``; SIGTERM/SIGINT drain running requests for ``--grace`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from coordinator.adaptive import KPolicy
from coordinator.balancer import BalancerPolicy
from coordinator.config import (DEFAULT_DRAFTER, DEFAULT_PORT, DEFAULT_STREAM_INTERVAL, DEFAULT_STREAM_INTERVAL_MS,
                                DEFAULT_VERIFIER, CoordinatorConfig, DataPlaneKind, Mode)
from coordinator.server import serve
from minedraft import telemetry


def parse_args(argv: list[str] | None = None) -> CoordinatorConfig:
    """Parse the command line into a validated :class:`CoordinatorConfig`."""
    p = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.PSD.value,
                   help="ar: target only; sd: draft then verify; psd: MineDraft batch-parallel SD")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens: draft tokens per step")
    p.add_argument("--max-num-seqs", type=int, default=8, help="m: batch size (psd runs up to 2m)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter_svc host:port")
    p.add_argument("--verifier", default=DEFAULT_VERIFIER, help="verifier_svc rank-0 host:port")
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="listen port")
    p.add_argument("--data-plane", choices=[d.value for d in DataPlaneKind], default=DataPlaneKind.INLINE.value,
                   help="how draft probs reach the verifier")
    p.add_argument("--max-queue-len", type=int, default=1024, help="most waiting requests")
    p.add_argument("--drafter-retry", type=float, default=2.0, help="seconds between probes of a lost drafter")
    p.add_argument("--rpc-timeout", type=float, default=120.0, help="deadline of each engine RPC (s)")
    p.add_argument("--engine-wait", type=float, default=600.0, help="seconds to wait for the engines at start")
    p.add_argument("--grace", type=float, default=5.0, help="drain seconds on SIGTERM")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics HTTP port (0 = off)")
    p.add_argument("--step-log", default="", help="append one JSON line per step to this file (minedraft timeline)")
    p.add_argument("--k-policy", choices=[k.value for k in KPolicy], default=KPolicy.FIXED.value,
                   help="fixed: k = --k always; adaptive: k in [1, --k] toward t_draft = t_verify (Lemma 2)")
    p.add_argument("--balancer", choices=[b.value for b in BalancerPolicy], default=BalancerPolicy.PAPER.value,
                   help="paper: new requests join skip_batch after the first step (MineDraft §5.1); "
                        "feedback: keep balancing the two batches by expected step cost")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="most prompt tokens admitted between two steps (0 = no limit; the queue's head always)")
    p.add_argument("--decode-steps", type=int, default=1,
                   help="ar steps: tokens per request decoded in one Verify call (multi-step decoding)")
    p.add_argument("--stream-decode-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="stream a multi-step call's tokens as they decode (else at the call's end)")
    p.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                   help="streamed multi-step calls: decode steps per partial message (1: every step)")
    p.add_argument("--stream-interval-ms", type=int, default=DEFAULT_STREAM_INTERVAL_MS,
                   help="... or a partial message once this many ms passed since the last (0: steps only)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return CoordinatorConfig(
            mode=a.mode, num_speculative_tokens=a.k, max_num_seqs=a.max_num_seqs, drafter=a.drafter,
            verifier=a.verifier, host=a.host, port=a.port, data_plane=a.data_plane, max_queue_len=a.max_queue_len,
            drafter_retry_s=a.drafter_retry, rpc_timeout_s=a.rpc_timeout, engine_wait_s=a.engine_wait,
            grace_s=a.grace, metrics_port=a.metrics_port, step_log=a.step_log, k_policy=a.k_policy,
            balancer=a.balancer, max_num_batched_tokens=a.max_num_batched_tokens,
            num_decode_steps=a.decode_steps, stream_decode_steps=a.stream_decode_steps,
            stream_interval=a.stream_interval, stream_interval_ms=a.stream_interval_ms,
        )
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> None:
    """Run the coordinator; exit status 1 when the engines never become ready."""
    cfg = parse_args(argv)
    telemetry.init_tracing("coordinator")  # OTEL_* environment (minedraft.telemetry)
    try:
        asyncio.run(serve(cfg))
    except (TimeoutError, RuntimeError) as exc:
        logging.getLogger("coordinator").error("cannot start: %s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
