"""Small probes the launcher uses on its children: grpc.health.v1 status, log tails and free
loopback ports (torch-free)."""

from __future__ import annotations

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


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (for test and soak stacks)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
