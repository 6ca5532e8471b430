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
import logging
import os
import sys

from engine_svc.service import DATA_PLANE_NAMES, add_common_args, check_common_args
from drafter_svc.servicer import DrafterServicer
from minedraft import telemetry
from specdec.models.footprint import GIB, InsufficientMemoryError, check_fits, model_footprint
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
    add_common_args(parser, DEFAULT_PORT)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.draft_sessions and args.engine != "vllm":
        parser.error("--draft-sessions: only with --engine vllm")
    if args.draft_proposer_tokens and (args.engine != "vllm" or args.draft_sessions):
        parser.error("--draft-proposer-tokens: only with --engine vllm and without --draft-sessions")
    if args.draft_proposer_tokens < 0:
        parser.error(f"--draft-proposer-tokens: must be >= 0, got {args.draft_proposer_tokens}")
    return args


def _target_vocab_size(args: argparse.Namespace, draft_dir: str) -> int | None:
    """Vocab size of ``--model`` (None without it); checks tokenizer compatibility when both
    dirs ship a tokenizer (raises ``IncompatibleDraftError``)."""
    if args.model is None:
        return None
    from transformers import AutoConfig

    from specdec.config import ModelConfig
    from specdec.models.loader import check_vocab_compat
    from specdec.models.resolve import resolve_model_dir

    target_dir = resolve_model_dir(ModelConfig(model=args.model))
    if all(os.path.isfile(os.path.join(d, "tokenizer_config.json")) for d in (target_dir, draft_dir)):
        check_vocab_compat(target_dir, draft_dir)
    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return int(config.get_text_config().vocab_size)


def check_draft_memory(draft_dir: str, args: argparse.Namespace) -> None:
    """Draft weights + draft KV (``--max-num-seqs`` x ``--max-model-len``) against available memory,
    before anything is allocated. Raises ``specdec.models.footprint.InsufficientMemoryError``."""
    try:
        footprint = model_footprint("draft", draft_dir, args.dtype, args.max_num_seqs, args.max_model_len)
    except (OSError, KeyError) as exc:  # e.g. a GGUF draft: no safetensors header to read
        logger.warning("draft memory check skipped: %s", exc)
        return
    total = check_fits([footprint])
    logger.info("draft memory: %.3f GiB (weights %.3f, KV cache %.3f)", total / GIB,
                footprint.weight_bytes / GIB, footprint.kv_cache_bytes / GIB)


def load_worker(args: argparse.Namespace):
    """Build the ``DraftWorker`` (blocking: loads the model)."""
    if args.engine == "vllm":
        return _load_vllm_worker(args)
    from specdec.config import CacheConfig, ModelConfig
    from specdec.models.resolve import resolve_model_dir
    from specdec.engine.runner import ModelRunner
    from specdec.engine.worker import DraftWorker

    model_cfg = ModelConfig(model=args.draft, gguf_file=args.draft_gguf_file, dtype=args.dtype,
                            device=args.device, num_threads=args.num_threads,
                            max_prefill_tokens=args.max_prefill_tokens,
                            max_graph_prefill_tokens=args.max_graph_prefill_tokens)
    cache_cfg = CacheConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    draft_dir = resolve_model_dir(model_cfg)
    check_draft_memory(draft_dir, args)
    target_vocab_size = _target_vocab_size(args, draft_dir)
    runner = ModelRunner(model_cfg, cache_cfg)
    return DraftWorker(runner, target_vocab_size=target_vocab_size, seed=args.seed)


def _load_vllm_worker(args: argparse.Namespace):
    """``VllmDraftWorker`` (with ``--draft-proposer-tokens``: drafting with vLLM's draft-model
    proposer), or ``VllmSessionDraftWorker`` with ``--draft-sessions`` (a MineDraft draft dir is
    exported to a standalone HF dir first)."""
    from engine_svc.service import vllm_engine_config
    from specdec.config import ModelConfig
    from specdec.models.resolve import resolve_model_dir
    from specdec.vllm_backend.draft import VllmDraftWorker
    from specdec.vllm_backend.draft_sessions import VllmSessionDraftWorker
    from specdec.vllm_backend.models import resolve_vllm_model

    target_dir = None if args.model is None else resolve_model_dir(ModelConfig(model=args.model))
    draft_dir, load_format = resolve_vllm_model(args.draft, target_dir)
    target_vocab_size = _target_vocab_size(args, draft_dir)
    if args.draft_sessions:
        cfg = vllm_engine_config(args, draft_dir, load_format, enable_prefix_caching=False)
        return VllmSessionDraftWorker(cfg, target_vocab_size, seed=args.seed)
    cfg = vllm_engine_config(args, draft_dir, load_format, proposer_tokens=args.draft_proposer_tokens)
    if cfg.proposer_tokens and cfg.device == "cuda":
        logger.warning("--draft-proposer-tokens: vLLM 0.24 runs the draft_model proposer on its V1 model runner; "
                       "a draft call measured 3.7-4.2x slower than k-step drafting on an H100 (BENCHMARKS.md)")
    return VllmDraftWorker(cfg, target_vocab_size, seed=args.seed)


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


async def serve(args: argparse.Namespace) -> None:
    """Run the drafter until SIGTERM/SIGINT."""
    server, health, port = await build_server(
        [SERVICE_NAME], ServerOptions(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes))
    servicer = DrafterServicer(args.draft, DATA_PLANE_NAMES[args.data_plane], _probs_server(args))
    engine_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    await server.start()
    logger.info("drafter listening on %s:%d (NOT_SERVING until warm-up)", args.host, port)
    try:
        servicer.attach(await servicer.executor.run(load_worker, args))
        await servicer.executor.run(servicer.warm_up)
    except BaseException:  # stop the server in this loop: its finalizer after the loop closed only adds noise
        await server.stop(None)
        raise
    await health.set_serving()
    logger.info("drafter SERVING %s on %s:%d (engine %s, data plane %s)", args.draft, args.host, port,
                args.engine, args.data_plane)
    try:
        await serve_until_signal(server, health, args.grace_s)
    finally:
        servicer.executor.shutdown()
        if servicer.probs_server is not None:
            servicer.probs_server.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    telemetry.init_tracing("drafter")  # OTEL_* environment (minedraft.telemetry)
    try:
        asyncio.run(serve(args))
    except InsufficientMemoryError as exc:  # fail at start with the reason, not mid-traffic
        logger.error("cannot start: %s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
