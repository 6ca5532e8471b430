"""``python -m drafter_svc``: the draft-model gRPC service (minedraft.v1.Drafter, port 50053).

Start-up: bind and report NOT_SERVING -> load the draft model (and read the target's vocab
size, so draft probs are padded to it) -> warm-up (add + draft + release of a dummy request)
-> SERVING. With ``--data-plane dist`` the drafter hosts the data plane's TCPStore on
``--dist-addr:--dist-port`` and serves draft-probs fetches from the verifier (specdec.dataplane.dist);
with ``--data-plane ipc`` it writes them into shared buffers (specdec.dataplane.ipc).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys

from engine_svc.service import DATA_PLANE_NAMES, add_common_args, check_common_args
from drafter_svc.servicer import DrafterServicer
from minedraft import telemetry
from drafter_svc.processes import DraftProcessError
from drafter_svc.worker import build_draft_engine
from specdec.models.footprint import InsufficientMemoryError
from minedraft.serving import ServerOptions, build_server, serve_until_signal
from minedraft.v1 import engine_pb2, engine_pb2_grpc

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
DEFAULT_PORT = 50053
logger = logging.getLogger("drafter_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m drafter_svc", description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, help="draft model: HF dir, MineDraft draft dir, or .gguf")
    parser.add_argument("--draft-gguf-file", default=None, help="GGUF file name inside --draft")
    parser.add_argument("--model", default=None,
                        help="target model (alias/dir): draft probs are padded to its vocab and "
                             "its tokenizer is checked against the draft's")
    parser.add_argument("--max-buffered-steps", type=int, default=8,
                        help="dist/ipc plane: drafted steps kept for the verifier's fetch")
    parser.add_argument("--draft-sessions", action="store_true",
                        help="--engine vllm: keep each request's draft request resident in vLLM (a resumable "
                             "session rolled back to what the verifier kept) instead of one new request per "
                             "draft call (specdec.vllm_backend.draft_sessions; prefix caching off)")
    parser.add_argument("--draft-proposer-tokens", type=int, default=0, metavar="N",
                        help="--engine vllm: draft with vLLM's own draft-model proposer: after each engine step's "
                             "sampled token the draft model proposes N more inside the step, so a draft call of "
                             "k <= N + 1 tokens is one engine step instead of k (greedy tokens after the first; "
                             "specdec.vllm_backend.draft; 0: off; not with --draft-sessions)")
    parser.add_argument("--draft-processes", type=int, default=1, metavar="P",
                        help="run the draft engine as P processes on the drafter's device, each request homed on "
                             "one, each with 1/P of --max-num-seqs (rounded up), of the GPU memory share or CPU KV "
                             "space and of --num-threads; a draft call runs its rows' processes side by side "
                             "(drafter_svc.processes; 1: the engine in this process)")
    add_common_args(parser, DEFAULT_PORT)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.draft_sessions and args.engine != "vllm":
        parser.error("--draft-sessions: only with --engine vllm")
    if args.draft_proposer_tokens and (args.engine != "vllm" or args.draft_sessions):
        parser.error("--draft-proposer-tokens: only with --engine vllm and without --draft-sessions")
    if not 1 <= args.draft_processes <= args.max_num_seqs:
        parser.error(f"--draft-processes: must be in [1, --max-num-seqs {args.max_num_seqs}], got {args.draft_processes}")
    if args.draft_proposer_tokens < 0:
        parser.error(f"--draft-proposer-tokens: must be >= 0, got {args.draft_proposer_tokens}")
    return args


def _probs_server(args: argparse.Namespace):
    if args.data_plane == "ipc":
        from specdec.dataplane.ipc import IpcPlaneConfig, IpcProbsServer

        server = IpcProbsServer(IpcPlaneConfig(name=args.ipc_name, device=args.device,
                                               num_slots=args.max_buffered_steps,
                                               max_batch_size=args.max_num_seqs))
        server.start()
        return server
    if args.data_plane != "dist":
        return None
    from specdec.dataplane.dist import DistPlaneConfig, DraftProbsServer

    server = DraftProbsServer(DistPlaneConfig(addr=args.dist_addr, port=args.dist_port,
                                              connect_timeout_s=args.dist_timeout_s,
                                              max_buffered_steps=args.max_buffered_steps,
                                              device=args.device))
    server.start()
    return server


async def serve(args: argparse.Namespace) -> bool:
    """Run the drafter until SIGTERM/SIGINT (or a draft process dies); whether a draft process died."""
    server, health, port = await build_server(
        [SERVICE_NAME], ServerOptions(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes))
    servicer = DrafterServicer(args.draft, DATA_PLANE_NAMES[args.data_plane], _probs_server(args))
    engine_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    await server.start()
    logger.info("drafter listening on %s:%d (NOT_SERVING until warm-up)", args.host, port)
    try:
        try:
            # a dead draft process: drain and exit non-zero (main), so the drafter is started afresh
            on_lost = functools.partial(os.kill, os.getpid(), signal.SIGTERM)
            servicer.attach(await servicer.executor.run(build_draft_engine, args, on_lost))
            await servicer.executor.run(servicer.warm_up)
        except BaseException:  # stop the server in this loop: its finalizer after the loop closed only adds noise
            await server.stop(None)
            raise
        await health.set_serving()
        logger.info("drafter SERVING %s on %s:%d (engine %s, data plane %s)", args.draft, args.host, port,
                    args.engine, args.data_plane)
        await serve_until_signal(server, health, args.grace_s)
    finally:   # also after a failed start: started draft processes would keep this process alive
        servicer.executor.shutdown()
        if hasattr(servicer.worker, "close"):   # DraftProcesses: stop the draft processes
            servicer.worker.close()
        if servicer.probs_server is not None:
            servicer.probs_server.stop()
    return getattr(servicer.worker, "is_lost", False)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    telemetry.init_tracing("drafter")  # OTEL_* environment (minedraft.telemetry)
    try:
        is_lost = asyncio.run(serve(args))
    except (InsufficientMemoryError, DraftProcessError) as exc:  # fail at start with the reason, not mid-traffic
        logger.error("cannot start: %s", exc)
        sys.exit(1)
    if is_lost:
        logger.error("stopped: a draft process died")
        sys.exit(1)


if __name__ == "__main__":
    main()
