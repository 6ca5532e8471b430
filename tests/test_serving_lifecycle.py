"""minedraft.serving lifecycle helpers in-process: SIGTERM drain, the health-watch wait (with
timeout and a cancelled watch retried), ServerOptions validation.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from minedraft.serving import ServerOptions, build_server


def test_serve_until_signal_drains_and_stops():
    """In-process: SIGTERM -> NOT_SERVING, drain callback awaited, server stopped."""
    from minedraft.serving import serve_until_signal

    async def scenario() -> list[str]:
        events = []
        server, health, port = await build_server(["minedraft.v1.Drafter"], ServerOptions())
        await server.start()
        await health.set_serving()

        async def drain():
            events.append(f"drain serving={health.is_serving}")

        task = asyncio.create_task(serve_until_signal(server, health, grace_s=1.0, on_drain=drain))
        await asyncio.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, 10)
        events.append("stopped")
        return events

    assert asyncio.run(scenario()) == ["drain serving=False", "stopped"]



def test_wait_for_serving_follows_the_health_watch_and_times_out():
    from minedraft.serving import wait_for_serving

    async def scenario() -> None:
        server, health, port = await build_server(["minedraft.v1.Verifier"])
        await server.start()
        target = f"127.0.0.1:{port}"
        waiter = asyncio.create_task(wait_for_serving(target, 10, service="minedraft.v1.Verifier"))
        await asyncio.sleep(0.3)
        assert not waiter.done()  # NOT_SERVING until the caller says so
        await health.set_serving()
        await asyncio.wait_for(waiter, 5)
        await server.stop(0)
        with pytest.raises(TimeoutError, match="not SERVING"):
            await wait_for_serving(target, 0.5)  # nothing listens any more

    asyncio.run(scenario())


@pytest.mark.parametrize("field, value", [("port", 70000), ("max_message_bytes", 0), ("host", "")])
def test_server_options_validation(field, value):
    with pytest.raises(ValueError, match=field):
        ServerOptions(**{field: value})


def test_wait_for_serving_retries_a_cancelled_watch():
    """A Watch stream ending with CANCELLED (an engine restarting) is retried, not fatal."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from minedraft.serving import wait_for_serving

    class RestartingHealth(health_pb2_grpc.HealthServicer):
        num_watches = 0

        async def Watch(self, request, context):
            RestartingHealth.num_watches += 1
            if RestartingHealth.num_watches == 1:
                await context.abort(grpc.StatusCode.CANCELLED, "restarting")
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def scenario() -> int:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(RestartingHealth(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await wait_for_serving(f"127.0.0.1:{port}", 10)
        finally:
            await server.stop(0)
        return RestartingHealth.num_watches

    assert asyncio.run(scenario()) == 2
