"""Runs the OpenAI-compatible FastAPI app (``gateway.http_api``) with uvicorn inside the
gateway's own asyncio loop, next to its gRPC server, so both share one ``GatewayServicer``."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from minedraft.serving import ServingHealth

from gateway.config import GatewayConfig
from gateway.http_api import OpenAIFrontend, build_app
from gateway.server import GatewayServicer

logger = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway's ``serve_until_signal`` owns them."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; raises OSError (e.g. port in use) right here
    rather than inside uvicorn, which would exit the process. Its protocol is named
    (``IPPROTO_TCP``): asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on connections
    whose socket says TCP, and with Nagle on every streamed event after the first waited for the
    client's delayed ACK (~40 ms on Linux: TTFT 60-75 ms where the gRPC API answered in 20)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """The HTTP API of one gateway: ``start`` binds and serves, ``stop`` drains and closes.

    Args:
        cfg: the gateway config (``host``, ``http_port`` > 0, ``api_key``, ``grace_s``).
        servicer: the gRPC servicer whose request handling the HTTP routes share.
        health: the gateway's health; ``/health`` answers 200 only while it is SERVING.
    """

    def __init__(self, cfg: GatewayConfig, servicer: GatewayServicer, health: ServingHealth) -> None:
        if cfg.http_port <= 0:
            raise ValueError(f"http_port: must be > 0 to serve HTTP, got {cfg.http_port}")
        app = build_app(OpenAIFrontend(servicer, health, cfg.api_key))
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=max(int(cfg.grace_s), 1))
        self._server = _EmbeddedServer(config)
        self._cfg = cfg
        self._task: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> int:
        """Binds ``host:http_port`` and serves in the background; returns the bound port.

        Raises:
            OSError: the port cannot be bound.
        """
        sock = bind_socket(self._cfg.host, self._cfg.http_port)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # re-raise the start-up error
        logger.info("HTTP (OpenAI API) on %s:%d", self._cfg.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stops accepting, lets open responses finish (up to ``grace_s``), closes."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
