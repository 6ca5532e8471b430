"""The gateway's HTTP socket: connections run without Nagle's algorithm (``TCP_NODELAY``).

With Nagle on, a streamed SSE event written while the previous one is unacknowledged waits for
the client's delayed ACK (~40 ms on Linux): every response and every first token paid it. asyncio
sets ``TCP_NODELAY`` on accepted connections only when their socket names ``IPPROTO_TCP``;
``gateway.http_server.bind_socket`` does, checked here on a connection that asyncio's server
(the one uvicorn runs on) accepts, and on a raw accept."""
from __future__ import annotations

import asyncio
import socket

from gateway.http_server import bind_socket


def _nodelay(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_connections_accepted_by_asyncio_have_nagle_off() -> None:
    async def accept_one() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                seen.set_result(_nodelay(transport.get_extra_info("socket")))
                transport.close()

        sock = bind_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accept_one()) != 0


def test_the_listening_socket_names_tcp_and_its_raw_accepts_have_nagle_off() -> None:
    sock = bind_socket("127.0.0.1", 0)
    with sock, socket.create_connection(sock.getsockname()) as client:
        conn, _ = sock.accept()
        with conn:
            assert sock.proto == socket.IPPROTO_TCP and conn.proto == socket.IPPROTO_TCP
            assert _nodelay(sock) != 0 and _nodelay(conn) != 0
        assert client is not None
