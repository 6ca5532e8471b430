"""Tensor wire format (engine_svc.tensor_proto) and the draft-probs data plane (specdec.dataplane.dist)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minedraft.probes import free_loopback_ports
from minedraft.v1 import common_pb2
from engine_svc.tensor_proto import (
    SUPPORTED_DTYPES,
    TensorDecodeError,
    is_empty_proto,
    proto_to_tensor,
    tensor_to_proto,
)

torch.set_num_threads(1)


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=gen, dtype=torch.int64).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    dtype_name=st.sampled_from(sorted(SUPPORTED_DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_bit_exact(shape, dtype_name, seed):
    tensor = _random_tensor(shape, SUPPORTED_DTYPES[dtype_name], seed)
    message = common_pb2.Tensor.FromString(tensor_to_proto(tensor).SerializeToString())
    decoded = proto_to_tensor(message)
    assert decoded.dtype == tensor.dtype
    assert tuple(decoded.shape) == tuple(tensor.shape)
    assert torch.equal(decoded.view(-1).view(torch.uint8) if decoded.numel() else decoded,
                       tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor)


def test_bfloat16_special_values_survive():
    tensor = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1e-40, 3.0e38], dtype=torch.bfloat16)
    decoded = proto_to_tensor(tensor_to_proto(tensor))
    assert torch.equal(decoded.view(torch.int16), tensor.view(torch.int16))


def test_wire_bytes_are_little_endian_row_major():
    tensor = torch.tensor([[1, 2], [3, 256]], dtype=torch.int32)
    message = tensor_to_proto(tensor)
    assert message.dtype == "int32" and list(message.shape) == [2, 2]
    assert message.data == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0])


def test_non_contiguous_input_is_encoded_in_logical_order():
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    assert torch.equal(proto_to_tensor(tensor_to_proto(tensor)), tensor)


def test_decoded_tensor_is_writable_copy():
    message = tensor_to_proto(torch.zeros(3))
    decoded = proto_to_tensor(message)
    decoded += 1  # must not raise (frombuffer memory is read-only)
    assert torch.equal(proto_to_tensor(message), torch.zeros(3))


@pytest.mark.parametrize(
    "message, match",
    [
        (common_pb2.Tensor(shape=[2], dtype="float64", data=b"\0" * 16), "unknown tensor dtype"),
        (common_pb2.Tensor(shape=[3], dtype="float32", data=b"\0" * 8), "needs 12"),
        (common_pb2.Tensor(shape=[-1], dtype="int32", data=b""), "negative"),
    ],
)
def test_invalid_messages_raise(message, match):
    with pytest.raises(TensorDecodeError, match=match):
        proto_to_tensor(message)


def test_unsupported_dtype_is_refused_on_encode():
    with pytest.raises(ValueError, match="not supported"):
        tensor_to_proto(torch.zeros(2, dtype=torch.float64))


def test_empty_proto_detection():
    assert is_empty_proto(common_pb2.Tensor())
    assert not is_empty_proto(tensor_to_proto(torch.zeros(0, 4)))


# --- dist data plane (specdec.dataplane.dist): both ranks in this process, one per thread ---


from specdec.dataplane.dist import (  # noqa: E402
    DistPlaneConfig,
    DraftProbsClient,
    DraftProbsMissingError,
    DraftProbsServer,
)


def _free_port() -> int:
    return free_loopback_ports(1)[0]   # below the ephemeral range (minedraft.probes)


@pytest.fixture
def dist_plane():
    cfg = DistPlaneConfig(port=_free_port(), connect_timeout_s=30, max_buffered_steps=2)
    server = DraftProbsServer(cfg)
    server.start()
    client = DraftProbsClient(cfg)
    client.connect()
    assert server.is_connected.wait(30)
    yield server, client
    client.close()
    server.stop()
    assert not server._thread.is_alive()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dist_fetch_is_exact_and_keeps_dtype(dist_plane, dtype):
    server, client = dist_plane
    probs = torch.softmax(torch.randn(3, 4, 50), dim=-1).to(dtype)
    server.publish(7, ["a", "b", "c"], probs)
    fetched = client.fetch(7, ["a", "b", "c"])
    assert fetched.dtype == dtype and torch.equal(fetched, probs)


def test_dist_fetch_selects_rows_of_surviving_requests(dist_plane):
    server, client = dist_plane
    probs = torch.rand(3, 2, 10)
    server.publish(1, ["a", "b", "c"], probs)
    fetched = client.fetch(1, ["c", "a"])  # "b" aborted between draft and verify
    assert torch.equal(fetched, probs[[2, 0]])


def test_dist_unfetched_steps_age_out_without_blocking(dist_plane):
    server, client = dist_plane
    for step in range(5):  # never fetched: nothing was sent, nothing can block
        server.publish(step, ["a"], torch.rand(1, 2, 10))
    assert server.num_evicted == 3
    with pytest.raises(DraftProbsMissingError, match="step 0"):
        client.fetch(0, ["a"])
    assert client.fetch(4, ["a"]).shape == (1, 2, 10)
    with pytest.raises(DraftProbsMissingError, match="step 4"):
        client.fetch(4, ["a"])  # a step is sent once


def test_dist_fetch_of_unknown_request_id_fails_clearly(dist_plane):
    server, client = dist_plane
    server.publish(3, ["a"], torch.rand(1, 2, 10))
    with pytest.raises(DraftProbsMissingError, match="zzz"):
        client.fetch(3, ["zzz"])


def test_dist_publish_validates_shapes():
    server = DraftProbsServer(DistPlaneConfig(port=_free_port()))
    with pytest.raises(ValueError, match="b=2"):
        server.publish(0, ["a", "b"], torch.rand(1, 2, 3))


@pytest.mark.parametrize("field, value", [("port", 0), ("max_buffered_steps", 0), ("addr", "")])
def test_dist_plane_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        DistPlaneConfig(**{field: value})


def test_dist_server_stops_while_idle_without_a_client_close():
    cfg = DistPlaneConfig(port=_free_port(), connect_timeout_s=30)
    server = DraftProbsServer(cfg)
    server.start()
    client = DraftProbsClient(cfg)
    client.connect()
    assert server.is_connected.wait(30)
    server.stop(timeout_s=5)  # the serving thread is blocked waiting for a request
    assert not server._thread.is_alive()


def test_dist_ragged_rows_carry_their_k_and_are_checked(dist_plane):
    """Ragged rows: each row's k_i travels with the probs; a fetch that describes the rows
    otherwise (a Verify reading padding as drafts) raises ValueError; a bad k_i never publishes."""
    server, client = dist_plane
    probs = torch.rand(3, 4, 10)
    probs[1, 1:] = 0
    server.publish(2, ["a", "b", "c"], probs, [4, 1, 3])
    assert torch.equal(client.fetch(2, ["c", "b"], [3, 1]), probs[[2, 1]])
    server.publish(3, ["a", "b"], probs[:2], [4, 1])
    with pytest.raises(ValueError, match=r"num_draft_tokens \[4, 4\] differ from the \[4, 1\]"):
        client.fetch(3, ["a", "b"], [4, 4])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        server.publish(4, ["a"], probs[:1], [5])
