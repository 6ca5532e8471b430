"""Unit tests of finish detection inside an accepted block (coordinator/finish.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.finish import FinishParams, FinishReason, apply_finish
from minedraft.v1 import common_pb2

EOS = 2


@pytest.mark.parametrize(
    ("block", "so_far", "params", "expected"),
    [
        ([5, 6, 7], 0, FinishParams(max_tokens=10), ([5, 6, 7], None)),
        ([5, EOS, 7], 0, FinishParams(max_tokens=10), ([5, EOS], FinishReason.STOP)),
        ([EOS, 7], 3, FinishParams(max_tokens=10), ([EOS], FinishReason.STOP)),
        ([5, EOS, 7], 0, FinishParams(max_tokens=10, ignore_eos=True), ([5, EOS, 7], None)),
        ([5, 9, 7], 0, FinishParams(max_tokens=10, stop_token_ids=(9,)), ([5, 9], FinishReason.STOP)),
        ([5, 9, 7], 0, FinishParams(max_tokens=10, stop_token_ids=(9,), ignore_eos=True), ([5, 9], FinishReason.STOP)),
        ([5, 6, 7, 8], 8, FinishParams(max_tokens=10), ([5, 6], FinishReason.LENGTH)),
        ([5, 6, 9], 8, FinishParams(max_tokens=10, stop_token_ids=(9,)), ([5, 6], FinishReason.LENGTH)),
        ([5, 9], 8, FinishParams(max_tokens=10, stop_token_ids=(9,)), ([5, 9], FinishReason.STOP)),
        ([5, 6], 9, FinishParams(max_tokens=10), ([5], FinishReason.LENGTH)),
        ([5], 10, FinishParams(max_tokens=10), ([], FinishReason.LENGTH)),
        ([], 0, FinishParams(max_tokens=10), ([], None)),
    ],
)
def test_apply_finish_cases(block, so_far, params, expected) -> None:
    assert apply_finish(block, so_far, params, (EOS,)) == expected


def test_accepts_proto_sampling_params() -> None:
    params = common_pb2.SamplingParams(max_tokens=4, stop_token_ids=[11], ignore_eos=False)
    assert apply_finish([3, 11, 4], 0, params, [EOS]) == ([3, 11], FinishReason.STOP)
    assert FinishParams.from_params(params) == FinishParams(max_tokens=4, stop_token_ids=(11,))


def test_finish_reason_strings() -> None:
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort"]
    assert FinishReason.STOP == "stop"


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"max_tokens": -3}, {"stop_token_ids": (-1,)}])
def test_finish_params_validation(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        FinishParams(**bad)


def test_negative_emitted_count_raises() -> None:
    with pytest.raises(ValueError, match="num_emitted_so_far"):
        apply_finish([1], -1, FinishParams(), (EOS,))


@given(
    blocks=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5), min_size=1, max_size=12),
    max_tokens=st.integers(1, 20),
    stop=st.sets(st.integers(0, 12), max_size=2),
    ignore_eos=st.booleans(),
)
def test_blockwise_equals_tokenwise(blocks, max_tokens, stop, ignore_eos) -> None:
    """Cutting block by block (speculative) gives the same output as one token at a time (AR)."""
    params = FinishParams(max_tokens=max_tokens, stop_token_ids=tuple(stop), ignore_eos=ignore_eos)
    stream = [t for block in blocks for t in block]

    def run(chunks):
        out, reason = [], None
        for chunk in chunks:
            emitted, reason = apply_finish(chunk, len(out), params, (EOS,))
            out += emitted
            if reason is not None:
                break
        return out, reason

    blockwise, tokenwise = run(blocks), run([[t] for t in stream])
    assert blockwise == tokenwise
    out, reason = blockwise
    assert len(out) <= max_tokens
    if reason == FinishReason.LENGTH:
        assert len(out) == max_tokens
    if reason == FinishReason.STOP:
        assert out[-1] in stop or (out[-1] == EOS and not ignore_eos)
