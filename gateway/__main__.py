"""``python -m gateway``: the public gRPC gateway of MineDraft (torch-free).

Serves ``minedraft.v1.MineDraft`` plus grpc.health.v1 (NOT_SERVING until the coordinator is
SERVING) and server reflection, and the OpenAI-compatible HTTP API on ``--http-port``
(``gateway.http_api``); SIGTERM/SIGINT drain in-flight streams for ``--grace`` seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

from minedraft import telemetry
from minedraft.serving import ServerOptions, build_server, serve_until_signal

from gateway.auth import ApiKeyInterceptor
from gateway.config import (DEFAULT_COORDINATOR, DEFAULT_HTTP_PORT, DEFAULT_MAX_N, DEFAULT_MODEL_NAME, DEFAULT_PORT,
                            GatewayConfig)
from gateway.http_server import HttpServer
from gateway.server import SERVICE_NAME, GatewayServicer, mirror_coordinator_health
from gateway.tokenizer import PromptTokenizer
from gateway.wire import add_gateway_servicer

logger = logging.getLogger("gateway")


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    """Parses the command line into a validated GatewayConfig."""
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="HF tokenizer dir of the target model")
    p.add_argument("--coordinator", default=DEFAULT_COORDINATOR, help="coordinator host:port")
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="listen port")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="served model id")
    p.add_argument("--draft-name", default="", help="draft model id shown by ListModels")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens per request")
    p.add_argument("--max-default-tokens", type=int, default=1024,
                   help="output budget when max_tokens is unset (capped by the free context)")
    p.add_argument("--grace", type=float, default=5.0, help="drain seconds on SIGTERM")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="OpenAI-compatible HTTP API port on --host (0 = off)")
    p.add_argument("--api-key", default=os.environ.get("MINEDRAFT_API_KEY", ""),
                   help="HTTP /v1/* and the gRPC MineDraft API need 'Authorization: Bearer KEY' "
                        "(gRPC: metadata 'authorization'; default: $MINEDRAFT_API_KEY; empty = open)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help="most choices (n, and best_of) one request may ask for; each is its own request")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return GatewayConfig(tokenizer=a.tokenizer, coordinator=a.coordinator, model_name=a.model_name,
                         draft_name=a.draft_name, max_model_len=a.max_model_len,
                         max_default_tokens=a.max_default_tokens, host=a.host, port=a.port, grace_s=a.grace,
                         http_port=a.http_port, api_key=a.api_key, max_n=a.max_n)


async def serve(cfg: GatewayConfig) -> None:
    """Loads the tokenizer, starts the server, mirrors coordinator health, serves until a signal."""
    tokenizer = await asyncio.to_thread(PromptTokenizer, cfg.tokenizer)
    interceptors = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []  # gRPC API key (gateway.auth)
    server, health, port = await build_server([SERVICE_NAME], ServerOptions(host=cfg.host, port=cfg.port),
                                              interceptors)
    servicer = GatewayServicer(cfg, tokenizer)
    add_gateway_servicer(servicer, server)  # malformed bodies -> INVALID_ARGUMENT (gateway.wire)
    await server.start()
    logger.info("gateway listening on %s:%d (coordinator %s, model %s)", cfg.host, port, cfg.coordinator, cfg.model_name)
    http = HttpServer(cfg, servicer, health) if cfg.http_port else None
    if http is not None:
        await http.start()
    mirror = asyncio.create_task(mirror_coordinator_health(cfg.coordinator, health, servicer.coordinator_channel))
    try:
        await serve_until_signal(server, health, grace_s=cfg.grace_s)
    finally:
        if http is not None:
            await http.stop()
        mirror.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await mirror
        await servicer.close()
    logger.info("gateway stopped")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    telemetry.init_tracing("gateway")  # OTEL_* environment (minedraft.telemetry)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
