"""Small probes the launcher uses on its children: grpc.health.v1 status, log tails and free
loopback ports (torch-free)."""

from __future__ import annotations

import random
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

NUM_LOG_TAIL_LINES = 40


def health_status(address: str, timeout_s: float = 2.0) -> int | None:
    """The overall grpc.health.v1 status of ``address``, or None when it does not answer."""
    try:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s).status
    except grpc.RpcError:
        return None


def log_tail(path: str, num_lines: int = NUM_LOG_TAIL_LINES) -> str:
    """The last ``num_lines`` lines of a log file ("" when missing)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])
    except OSError:
        return ""


LOW_PORT = 20000   # free_loopback_ports draws from [LOW_PORT, the kernel's first ephemeral port)
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_loopback_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (for test and soak stacks).

    Drawn at random below the kernel's ephemeral range (``EPHEMERAL_RANGE``, from ``LOW_PORT``):
    a port the kernel hands out itself can be taken by any outgoing connection's local end before
    the service that was given it binds it (a test stack's coordinator once failed with "Address
    already in use" so); a port below that range can only be taken by another bind. Falls back to
    ports the kernel picks where the range cannot be read or holds too few free ports.
    """
    rng = rng or random.Random()
    first_ephemeral = _first_ephemeral_port()
    ports: list[int] = []
    tries = 0
    while first_ephemeral > LOW_PORT + count and len(ports) < count and tries < 50 * count:
        tries += 1
        port = rng.randrange(LOW_PORT, first_ephemeral)
        if port not in ports and _is_free(port):
            ports.append(port)
    return ports if len(ports) == count else _kernel_picked_ports(count)


def _first_ephemeral_port() -> int:
    try:
        with open(EPHEMERAL_RANGE, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_picked_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
