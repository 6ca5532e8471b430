"""``python -m verifier_svc``: the target-model gRPC service (minedraft.v1.Verifier, port 50054).

Tensor parallel, ``--engine native``: ``torchrun --nproc-per-node N -m verifier_svc ...``; every
rank loads its shard (``tp_plan="auto"``), rank 0 serves gRPC and broadcasts the commands
(verifier_svc.tp). ``--engine vllm``: one process, ``--tensor-parallel-size N`` (vLLM starts
its own workers); ``--num-speculative-tokens`` is the largest k the coordinator sends (0: plain
decoding only, as ``ar`` needs; specdec.vllm_backend).
Start-up: bind and report NOT_SERVING -> load the model -> warm-up (add + verify + release of
a dummy request, on every rank) -> SERVING. With ``--data-plane dist`` rank 0 joins the
drafter's data-plane group on ``--dist-addr:--dist-port`` (specdec.dataplane.dist); with ``ipc`` it
maps the drafter's shared buffers (specdec.dataplane.ipc).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from engine_svc.service import DATA_PLANE_NAMES, add_common_args, check_common_args
from minedraft import telemetry
from minedraft.serving import ServerOptions, build_server, serve_until_signal
from minedraft.v1 import engine_pb2
from verifier_svc.tp import TPContext

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
DEFAULT_PORT = 50054
logger = logging.getLogger("verifier_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m verifier_svc", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="target model: alias, HF dir, or dir/.gguf")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    parser.add_argument("--bench-fixed-acceptance", type=float, default=None, metavar="P",
                        help="BENCHMARK-ONLY: accept each draft token with probability P instead of "
                             "rejection sampling (changes the output distribution; specdec.sample.fixed_acceptance)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="--engine vllm: vLLM's tensor parallelism (native: run under torchrun)")
    parser.add_argument("--num-speculative-tokens", type=int, default=8,
                        help="--engine vllm: the largest k verified per request and step (0: decode only)")
    add_common_args(parser, DEFAULT_PORT)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.engine == "vllm" and TPContext.from_env().is_distributed:
        parser.error("--engine vllm runs tensor parallelism itself: use --tensor-parallel-size, not torchrun")
    if args.engine == "native" and args.tensor_parallel_size != 1:
        parser.error("--tensor-parallel-size is for --engine vllm; the native engine runs TP under torchrun")
    if args.bench_fixed_acceptance is not None:
        from specdec.sample.bench_only import check_acceptance_prob

        try:
            check_acceptance_prob(args.bench_fixed_acceptance)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def load_engine(args: argparse.Namespace, ctx: TPContext):
    """Build this rank's ``VerifierEngine`` (blocking: loads the model, joins the TP group)."""
    if args.engine == "vllm":
        return _load_vllm_engine(args)
    from specdec.config import CacheConfig, ModelConfig
    from specdec.engine.runner import ModelRunner
    from specdec.engine.worker import TargetWorker
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.tp import CommandChannel, init_distributed, load_tp_model

    device = init_distributed(ctx, args.device)
    model_cfg = ModelConfig(model=args.model, gguf_file=args.gguf_file, dtype=args.dtype,
                            device=device, num_threads=args.num_threads,
                            max_prefill_tokens=args.max_prefill_tokens,
                            max_graph_prefill_tokens=args.max_graph_prefill_tokens)
    cache_cfg = CacheConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    model = load_tp_model(model_cfg, ctx) if ctx.is_distributed else None
    worker = TargetWorker(ModelRunner(model_cfg, cache_cfg, model=model), seed=args.seed,
                          fixed_acceptance=_fixed_acceptance(args))
    channel = CommandChannel(device) if ctx.is_distributed else None
    return VerifierEngine(worker, channel, _probs_client(args, ctx, device), seed=args.seed)


def _load_vllm_engine(args: argparse.Namespace):
    """``VerifierEngine`` over ``VllmTargetWorker`` (draft probs are not needed: no data plane)."""
    from engine_svc.service import vllm_engine_config
    from specdec.vllm_backend.models import resolve_vllm_model
    from specdec.vllm_backend.target import VllmTargetWorker
    from verifier_svc.engine import VerifierEngine

    fixed = _fixed_acceptance(args) if args.num_speculative_tokens > 0 else None  # ar: nothing to accept
    model_dir, load_format = resolve_vllm_model(args.model)
    cfg = vllm_engine_config(args, model_dir, load_format, tensor_parallel_size=args.tensor_parallel_size,
                             num_speculative_tokens=args.num_speculative_tokens,
                             fixed_acceptance=None if fixed is None else fixed.acceptance_prob)
    return VerifierEngine(VllmTargetWorker(cfg), seed=args.seed)


def _fixed_acceptance(args: argparse.Namespace):
    """``specdec.sample.fixed_acceptance.FixedAcceptance`` from ``--bench-fixed-acceptance`` (None: off),
    announced loudly: it changes the output distribution."""
    if args.bench_fixed_acceptance is None:
        return None
    from specdec.sample.bench_only import fixed_acceptance_label
    from specdec.sample.fixed_acceptance import FixedAcceptance

    config = FixedAcceptance(args.bench_fixed_acceptance)
    logger.warning("%s: every draft token is accepted with probability %g, NOT by rejection sampling; "
                   "outputs are NOT the target model's distribution", fixed_acceptance_label(config.acceptance_prob),
                   config.acceptance_prob)
    return config


def _probs_client(args: argparse.Namespace, ctx: TPContext, device: str):
    """Rank 0's draft-probs client for ``--data-plane dist`` or ``ipc`` (None otherwise)."""
    if args.data_plane not in ("dist", "ipc") or not ctx.is_driver:
        return None
    if args.data_plane == "ipc":
        from specdec.dataplane.ipc import IpcPlaneConfig, IpcProbsClient

        return IpcProbsClient(IpcPlaneConfig(name=args.ipc_name, device=device,
                                             connect_timeout_s=args.dist_timeout_s))
    from specdec.dataplane.dist import DistPlaneConfig, DraftProbsClient

    client = DraftProbsClient(DistPlaneConfig(addr=args.dist_addr, port=args.dist_port,
                                              connect_timeout_s=args.dist_timeout_s, device=device))
    client.start_connect()
    return client


async def serve(args: argparse.Namespace, ctx: TPContext) -> None:
    """Rank 0: serve gRPC until SIGTERM/SIGINT, then stop the other ranks."""
    from verifier_svc.servicer import VerifierServicer

    server, health, port = await build_server(
        [SERVICE_NAME], ServerOptions(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes))
    tp_size = args.tensor_parallel_size if args.engine == "vllm" else ctx.world_size
    servicer = VerifierServicer(_served_name(args), DATA_PLANE_NAMES[args.data_plane], tp_size)
    from minedraft.v1 import engine_pb2_grpc  # here: load_engine (bench, TP checks) needs no gRPC stubs

    engine_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    await server.start()
    logger.info("verifier listening on %s:%d (NOT_SERVING until warm-up)", args.host, port)
    try:
        engine = await servicer.executor.run(load_engine, args, ctx)
    except BaseException:  # stop the server in this loop: its finalizer after the loop closed only adds noise
        await server.stop(None)
        raise
    try:
        servicer.attach(engine)
        await servicer.executor.run(servicer.warm_up)
        await health.set_serving()
        logger.info("verifier SERVING %s on %s:%d (engine %s, TP=%d, data plane %s)",
                    args.model, args.host, port, args.engine, tp_size, args.data_plane)
        await serve_until_signal(server, health, args.grace_s)
    finally:
        await servicer.executor.run(_close, engine)
        servicer.executor.shutdown()


def _served_name(args: argparse.Namespace) -> str:
    """``EngineInfo.model``: the model, with the benchmark-only label when fixed acceptance is on."""
    if args.bench_fixed_acceptance is None:
        return args.model
    from specdec.sample.bench_only import fixed_acceptance_label

    return f"{args.model} [{fixed_acceptance_label(args.bench_fixed_acceptance)}]"


def _close(engine) -> None:
    engine.shutdown()
    if engine.probs_client is not None and engine.probs_client.is_connected:
        engine.probs_client.close()


def follow(args: argparse.Namespace, ctx: TPContext) -> None:
    """Ranks > 0: load the shard, then apply rank 0's commands until SHUTDOWN.

    SIGTERM/SIGINT are ignored here: torchrun forwards them to every rank, and these ranks must
    stay until rank 0 has drained and broadcast SHUTDOWN (torchrun kills them if rank 0 dies).
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    load_engine(args, ctx).follow()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx = TPContext.from_env()
    if ctx.is_driver:  # rank 0 serves the RPCs; other ranks' spans would be parentless roots
        telemetry.init_tracing("verifier")  # OTEL_* environment (minedraft.telemetry)
    try:
        if ctx.is_driver:
            asyncio.run(serve(args, ctx))
        else:
            follow(args, ctx)
    finally:
        if ctx.is_distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
