"""``minedraft generate`` against a scripted in-process gRPC gateway (no model): the answer streams
to stdout; a gRPC error (the call's status, or an error inside the stream) is one line
``error: <status code>: <details>`` on stderr, no traceback, exit status 2 for INVALID_ARGUMENT and
1 otherwise."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from minedraft import cli
from minedraft.v1 import common_pb2, generate_pb2, generate_pb2_grpc

from gateway_harness import _free_port


class ScriptedGateway(generate_pb2_grpc.MineDraftServicer):
    """Answers every Generate with ``status`` (aborting the call) or with ``responses``."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.responses: list[generate_pb2.GenerateResponse] = []

    def Generate(self, request, context):
        if self.status is not None:
            context.abort(*self.status)
        yield from self.responses


@pytest.fixture(scope="module")
def served():
    """(ScriptedGateway, its address)."""
    gateway = ScriptedGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_MineDraftServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield gateway, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def gateway(served):
    scripted, address = served
    scripted.status, scripted.responses = None, []
    return scripted, address


def _generate(address: str, capsys) -> tuple[int, str, str]:
    code = cli.main(["generate", "hi", "--gateway", address, "--max-tokens", "4"])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_the_answer(gateway, capsys):
    scripted, address = gateway
    scripted.responses = [generate_pb2.GenerateResponse(chunk=generate_pb2.GenerateChunk(token_ids=[1], text="Hel")),
                          generate_pb2.GenerateResponse(chunk=generate_pb2.GenerateChunk(token_ids=[2], text="lo")),
                          generate_pb2.GenerateResponse(complete=generate_pb2.GenerateComplete(text="Hello"))]
    assert _generate(address, capsys) == (0, "Hello\n", "")


@pytest.mark.parametrize("status,exit_code", [(grpc.StatusCode.INVALID_ARGUMENT, 2),
                                              (grpc.StatusCode.RESOURCE_EXHAUSTED, 1)])
def test_generate_prints_a_refused_call_as_one_line(gateway, capsys, status, exit_code):
    scripted, address = gateway
    scripted.status = (status, "prompt: prompt has 99 tokens;\nmax_model_len is 64")
    code, _, err = _generate(address, capsys)
    assert code == exit_code
    assert err == f"error: {status.name}: prompt: prompt has 99 tokens; max_model_len is 64\n"


def test_generate_prints_an_error_inside_the_stream_as_one_line(gateway, capsys):
    scripted, address = gateway
    error = common_pb2.GenerateError(code=grpc.StatusCode.UNAVAILABLE.value[0], message="verifier died")
    scripted.responses = [generate_pb2.GenerateResponse(chunk=generate_pb2.GenerateChunk(token_ids=[1], text="He")),
                          generate_pb2.GenerateResponse(error=error)]
    assert _generate(address, capsys) == (1, "He\n", "error: UNAVAILABLE: verifier died\n")


def test_generate_without_a_gateway_is_one_line_unavailable(capsys):
    code, _, err = _generate(f"127.0.0.1:{_free_port()}", capsys)
    assert code == 1 and err.startswith("error: UNAVAILABLE: ") and err.count("\n") == 1, err


def test_generate_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "exit status" in capsys.readouterr().out
