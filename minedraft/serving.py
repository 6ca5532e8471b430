"""Shared grpc.aio server and client helpers for every MineDraft service (torch-free).

Each service (gateway, coordinator, drafter, verifier) builds its server the same way:

    server, health = await build_server(["minedraft.v1.Drafter"], port=50053)
    engine_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    await server.start()
    ...warm up...
    await health.set_serving()
    await serve_until_signal(server, health, grace_s=5.0, on_drain=servicer.drain)

What a server gets:
- message size limits on send and receive (default 64 MiB, ``DEFAULT_MAX_MESSAGE_BYTES``);
- the standard ``grpc.health.v1.Health`` service (grpcio-health-checking), reporting the
  overall status ``""`` and each service's full name; NOT_SERVING until the caller calls
  ``ServingHealth.set_serving()`` after its warm-up;
- server reflection (grpcio-reflection) for the service names plus health and reflection;
- a bind to 127.0.0.1 by default (loopback only).

Shutdown (``serve_until_signal``): SIGTERM/SIGINT -> every health status NOT_SERVING (so load
balancers and ``wait_for_serving`` callers stop routing) -> optional ``on_drain`` awaited with
a deadline of ``grace_s`` -> ``server.stop(grace_s)`` (in-flight RPCs get the rest of the grace).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minedraft import telemetry

from minedraft import telemetry

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_GRACE_S = 5.0
MAX_RECONNECT_BACKOFF_MS = 1000
_BACKOFF_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]
OVERALL_SERVICE = ""  # the health name that stands for the whole server
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_RETRY_DELAY_S = 0.1
# Watch stream outcomes that mean "not yet": server down/restarting, stream cut, deadline of one try
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class ServerOptions:
    """Where and how a service listens.

    Raises ValueError naming the field when a value is out of range.
    """

    host: str = DEFAULT_HOST
    port: int = 0  # 0 = pick a free port (tests); the bound port is returned by build_server
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")


def message_size_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel/server options that raise both message size limits to ``max_message_bytes``."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def aio_channel(target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to ``target`` ("host:port") with matching size limits; with
    tracing on (``minedraft.telemetry``) its calls carry the current trace context. Its reconnect
    backoff is capped at ``MAX_RECONNECT_BACKOFF_MS`` (gRPC's default grows to 120 s, so a restarted
    service would stay unreachable long after it is back)."""
    return grpc.aio.insecure_channel(target, options=[*message_size_options(max_message_bytes), *_BACKOFF_OPTIONS],
                                     interceptors=telemetry.client_interceptors() or None)


class ServingHealth:
    """The grpc.health.v1 servicer of one server, for the overall status and its services.

    Every status starts NOT_SERVING; ``set_serving`` flips them all after warm-up.
    """

    def __init__(self, service_names: Sequence[str]) -> None:
        self.service_names: tuple[str, ...] = (OVERALL_SERVICE, *service_names)
        self.servicer = health.aio.HealthServicer()
        self.is_serving = False

    async def _set_all(self, status: int) -> None:
        for name in self.service_names:
            await self.servicer.set(name, status)

    async def set_serving(self) -> None:
        """Report SERVING for "" and every service name (no-op once shutdown began)."""
        await self._set_all(SERVING)
        self.is_serving = True

    async def set_not_serving(self) -> None:
        """Report NOT_SERVING for "" and every service name."""
        await self._set_all(NOT_SERVING)
        self.is_serving = False

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every name, permanently (later ``set_serving`` calls are ignored)."""
        await self.servicer.enter_graceful_shutdown()
        self.is_serving = False


async def build_server(
    service_names: Sequence[str],
    options: ServerOptions | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, ServingHealth, int]:
    """Create a grpc.aio server with health (all NOT_SERVING) and reflection, bound but not started.

    Args:
        service_names: full names of the services the caller will add, e.g. "minedraft.v1.Drafter".
        options: host, port and message size limit; defaults to 127.0.0.1, a free port, 64 MiB.
        interceptors: extra grpc.aio server interceptors; OpenTelemetry's are added when tracing
            is on (``minedraft.telemetry``).

    Returns:
        (server, health, bound_port). Add servicers, then ``await server.start()``.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    options = options or ServerOptions()
    server = grpc.aio.server(
        interceptors=[*telemetry.server_interceptors(), *interceptors],
        # SO_REUSEPORT off: a second process on a taken port must fail, not silently share traffic.
        options=[*message_size_options(options.max_message_bytes), ("grpc.so_reuseport", 0)],
    )
    serving_health = ServingHealth(service_names)
    await serving_health.set_not_serving()
    health_pb2_grpc.add_HealthServicer_to_server(serving_health.servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{options.host}:{options.port}"
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind gRPC server to {address}: {exc}") from exc
    if bound_port == 0:
        raise RuntimeError(f"cannot bind gRPC server to {address}")
    return server, serving_health, bound_port


async def _run_drain(on_drain: Callable[[], Awaitable[None] | None] | None, grace_s: float) -> None:
    if on_drain is None:
        return
    try:
        result = on_drain()
        if inspect.isawaitable(result):
            await asyncio.wait_for(result, timeout=grace_s)
    except asyncio.TimeoutError:
        logger.warning("drain did not finish within %.1f s; stopping anyway", grace_s)
    except Exception:  # a failing drain must not prevent the stop
        logger.exception("drain failed; stopping anyway")


async def serve_until_signal(
    server: grpc.aio.Server,
    health: ServingHealth,
    grace_s: float = DEFAULT_GRACE_S,
    on_drain: Callable[[], Awaitable[None] | None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or the server terminates), then shut down gracefully.

    Steps on a signal: health -> NOT_SERVING for every name; ``on_drain()`` awaited for at most
    ``grace_s`` seconds; ``await server.stop(grace_s)``. Must run in the server's event loop
    in the main thread (signal handlers).
    """
    loop = asyncio.get_running_loop()
    stop_event = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop_event.set)
    stop_wait = asyncio.ensure_future(stop_event.wait())
    termination = asyncio.ensure_future(server.wait_for_termination())
    try:
        await asyncio.wait({stop_wait, termination}, return_when=asyncio.FIRST_COMPLETED)
        if stop_event.is_set():
            logger.info("signal received: draining (grace %.1f s)", grace_s)
            await health.enter_graceful_shutdown()
            await _run_drain(on_drain, grace_s)
            await server.stop(grace_s)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        for task in (stop_wait, termination):
            task.cancel()


async def _watch_once(channel: grpc.aio.Channel, service: str, deadline: float) -> bool:
    """Follow one health Watch stream until SERVING (True) or the deadline (False)."""
    stub = health_pb2_grpc.HealthStub(channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=max(deadline - time.monotonic(), 0.01))
    try:
        async for response in call:
            if response.status == SERVING:
                return True
    finally:
        call.cancel()
    return False


async def wait_for_serving(target: str, timeout_s: float, service: str = OVERALL_SERVICE) -> None:
    """Wait until the server at ``target`` reports SERVING for ``service`` (default: overall).

    Follows the health Watch stream; retries while the server is not up yet (UNAVAILABLE), the
    stream ends or is cancelled (CANCELLED: e.g. the server is restarting), until ``timeout_s``
    seconds have passed.

    Raises:
        TimeoutError: not SERVING within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    async with aio_channel(target) as channel:
        while time.monotonic() < deadline:
            try:
                if await _watch_once(channel, service, deadline):
                    return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY_CODES:
                    raise
            await asyncio.sleep(min(_RETRY_DELAY_S, max(deadline - time.monotonic(), 0)))
    raise TimeoutError(f"{target} (service {service!r}) not SERVING within {timeout_s:.1f} s")


def wait_for_serving_sync(target: str, timeout_s: float, service: str = OVERALL_SERVICE) -> None:
    """Blocking ``wait_for_serving`` for code without an event loop (CLI, tests)."""
    asyncio.run(wait_for_serving(target, timeout_s, service))


async def mirror_health(target: str, health: ServingHealth, retry_s: float = 0.5,
                        channel: grpc.aio.Channel | None = None) -> None:
    """Keep ``health`` SERVING only while the server at ``target`` reports SERVING (overall).

    Pass the ``channel`` the caller sends its own RPCs on (not closed here): SERVING is then only
    reported once that very channel is connected, not merely some other channel to ``target``.

    Follows its health Watch stream; when the stream breaks (the server died or restarts) or
    reports anything but SERVING, ``health`` goes NOT_SERVING, and the watch is retried every
    ``retry_s`` seconds. ``health`` stays NOT_SERVING for good once it entered graceful shutdown
    (grpcio's health servicer ignores later sets). Runs until cancelled.
    """
    if channel is None:
        async with aio_channel(target) as own_channel:
            await mirror_health(target, health, retry_s, own_channel)
        return
    stub = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            async for response in stub.Watch(health_pb2.HealthCheckRequest(service=OVERALL_SERVICE)):
                if response.status == SERVING:
                    await health.set_serving()
                else:
                    await health.set_not_serving()
        except grpc.aio.AioRpcError as exc:
            logger.debug("health watch of %s: %s", target, exc.code())
        if health.is_serving:
            logger.warning("%s is not SERVING any more; reporting NOT_SERVING", target)
        await health.set_not_serving()
        await asyncio.sleep(retry_s)
