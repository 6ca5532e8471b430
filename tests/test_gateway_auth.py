"""Optional gRPC API key of the gateway (gateway.auth): UNAUTHENTICATED without the right
``authorization: Bearer`` metadata; health stays open."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import ApiKeyInterceptor
from minedraft.client import MineDraftClient
from minedraft.serving import build_server
from minedraft.v1 import generate_pb2, generate_pb2_grpc

KEY = "s3cret-key"


class EchoModels(generate_pb2_grpc.MineDraftServicer):
    """Answers ListModels and a one-message Generate: what sits behind the interceptor."""

    async def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelCard(id="m")])

    async def Generate(self, request, context):
        yield generate_pb2.GenerateResponse(request_id=request.request_id,
                                            complete=generate_pb2.GenerateComplete(finish_reason="length"))


@pytest.fixture(scope="module")
def address():
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state = {}

    async def start():
        server, health, port = await build_server(["minedraft.v1.MineDraft"], interceptors=[ApiKeyInterceptor(KEY)])
        generate_pb2_grpc.add_MineDraftServicer_to_server(EchoModels(), server)
        await server.start()
        await health.set_serving()
        state.update(server=server, port=port)
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(10)
    yield f"127.0.0.1:{state['port']}"
    asyncio.run_coroutine_threadsafe(state["server"].stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.parametrize("api_key", ["", "wrong-key"])
def test_missing_or_wrong_key_is_unauthenticated(address, api_key):
    with MineDraftClient(address, timeout_s=10, api_key=api_key) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.list_models()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            client.generate("hi", max_tokens=1)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()


def test_right_key_passes_and_health_needs_none(address):
    with MineDraftClient(address, timeout_s=10, api_key=KEY) as client:
        assert [m.id for m in client.list_models()] == ["m"]
        assert client.generate("hi", max_tokens=1).finish_reason == "length"
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_empty_key_is_refused():
    with pytest.raises(ValueError, match="api_key"):
        ApiKeyInterceptor("")


def test_generate_command_sends_the_api_key_from_the_flag_or_the_environment(address, monkeypatch, capsys):
    """Issue 25.6: ``minedraft generate --api-key`` / ``MINEDRAFT_API_KEY`` reach a keyed gateway."""
    from minedraft import cli

    monkeypatch.delenv("MINEDRAFT_API_KEY", raising=False)
    assert cli.main(["generate", "hi", "--gateway", address]) == cli.EXIT_FAILED
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--gateway", address, "--api-key", KEY]) == 0
    monkeypatch.setenv("MINEDRAFT_API_KEY", KEY)
    assert cli.main(["generate", "hi", "--gateway", address]) == 0
    assert "UNAUTHENTICATED" not in capsys.readouterr().err


def test_prompts_command_sends_the_api_key(address, monkeypatch, tmp_path, capsys):
    from minedraft import cli

    monkeypatch.delenv("MINEDRAFT_API_KEY", raising=False)
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "writing", "turns": ["Hi"]}\n')
    out = tmp_path / "metrics.json"
    assert cli.main(["prompts", str(path), "--gateway", address, "--api-key", KEY, "--limit", "1",
                     "--wait", "5", "--out", str(out)]) == 0
    import json

    assert json.loads(out.read_text())["num_requests"] == 1
    with pytest.raises(grpc.RpcError) as info:
        cli.main(["prompts", str(path), "--gateway", address, "--limit", "1", "--wait", "5"])
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
