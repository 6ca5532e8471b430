"""CoordinatorConfig validation and the coordinator's tensor helpers (token-id rows, prob rows)."""

from __future__ import annotations

import struct

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.engines import decode_token_ids, encode_token_ids, join_prob_rows, split_prob_rows
from coordinator.request import PendingDrafts
from minedraft.v1 import common_pb2


@pytest.mark.parametrize(
    "bad",
    [{"mode": "fast"}, {"num_speculative_tokens": 0}, {"max_num_seqs": 0}, {"drafter": "nohost"},
     {"port": 70000}, {"metrics_port": -1}, {"data_plane": "nccl"}, {"max_queue_len": 0}, {"rpc_timeout_s": 0}, {"grace_s": -1}],
)
def test_config_validation_names_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        CoordinatorConfig(**bad)


def test_config_running_cap() -> None:
    assert CoordinatorConfig(mode="psd", max_num_seqs=4).max_num_running == 8
    assert CoordinatorConfig(mode="sd", max_num_seqs=4).max_num_running == 4
    assert not CoordinatorConfig(mode="ar").uses_drafter


def test_tensor_helpers_round_trip_and_reject_bad_shapes() -> None:
    rows = [[1, 2, 3], [40000, 0, 7]]
    assert decode_token_ids(encode_token_ids(rows)) == rows
    with pytest.raises(ValueError, match="rows"):
        encode_token_ids([[1], [1, 2]])
    with pytest.raises(ValueError, match="tensor"):
        decode_token_ids(common_pb2.Tensor(shape=[2, 2], dtype="int32", data=b"\0" * 12))
    probs = common_pb2.Tensor(shape=[2, 1, 3], dtype="float32", data=struct.pack("<6f", *range(6)))
    first, second = split_prob_rows(probs, 2)
    assert struct.unpack("<3f", second) == (3.0, 4.0, 5.0)
    drafts = [PendingDrafts(1, [5], second, "float32", 3, True), PendingDrafts(1, [6], first, "float32", 3, True)]
    joined = join_prob_rows(drafts)
    assert list(joined.shape) == [2, 1, 3] and struct.unpack("<6f", joined.data) == (3, 4, 5, 0, 1, 2)
    with pytest.raises(ValueError, match="tensor"):
        split_prob_rows(probs, 3)
