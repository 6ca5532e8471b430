"""Issue 25.6: an id re-sent right after a client cancel is served, not refused "already in flight"
while the cancelled stream's abort is still landing at the coordinator. A real ``python -m gateway``
in front of the fake coordinator (tests/test_gateway.py's ``stack``), whose Abort can be slowed.
"""
from __future__ import annotations

import time

import grpc
import pytest

from minedraft.client import MineDraftClient, build_request
from test_gateway import stack  # noqa: F401  (module fixture: gateway subprocess, fake coordinator)


@pytest.fixture
def fake(stack, tokenizer):  # noqa: F811
    fake, _ = stack
    fake.script = [[tokenizer.encode(" a", add_special_tokens=False)[0]]] * 40
    fake.step_delay_s = 0.05
    yield fake
    fake.abort_delay_s = 0.0


@pytest.mark.parametrize("abort_delay_s", [0.0, 0.5])
def test_an_id_resent_right_after_a_cancel_is_served(stack, fake, abort_delay_s):  # noqa: F811
    _, port = stack
    fake.abort_delay_s = abort_delay_s
    with MineDraftClient(f"127.0.0.1:{port}", timeout_s=30) as client:
        for attempt in range(8):
            request_id = f"resend-{abort_delay_s}-{attempt}"
            old = client.stream(build_request("hi", request_id=request_id, max_tokens=40))
            assert next(old).WhichOneof("response") == "chunk"
            old.close()  # client cancel; the same id again at once
            again = client.stream(build_request("hi", request_id=request_id, max_tokens=2))
            kinds = [response.WhichOneof("response") for response in again]  # raises on INVALID_ARGUMENT
            assert kinds[-1] == "complete", kinds
            assert fake.aborted.count(request_id) == 1  # the cancelled one was aborted, once


def test_a_real_duplicate_is_still_refused_at_once(stack, fake):  # noqa: F811
    _, port = stack
    with MineDraftClient(f"127.0.0.1:{port}", timeout_s=30) as client:
        running = client.stream(build_request("hi", request_id="dup-live", max_tokens=40))
        assert next(running).WhichOneof("response") == "chunk"
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(client.stream(build_request("hi", request_id="dup-live", max_tokens=2)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("request_id:") and "already in flight" in info.value.details()
        assert time.monotonic() - start < 2.0
        running.close()
