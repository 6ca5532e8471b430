"""Tests for specdec.sample.sampling: params validation, logits processors, per-request generators."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.sample.sampling import (
    SamplingParams,
    inverse_cdf_sample,
    logits_to_probs,
    make_generator,
    sample_from_probs,
)

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
    ],
)
def test_params_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_defaults_and_stop_ids_tuple():
    params = SamplingParams(stop_token_ids=[5, 7])
    assert params.stop_token_ids == (5, 7)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    SamplingParams(top_k=0)  # alias for off
    SamplingParams(top_p=1.0, min_p=1.0, seed=0)


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor([rows], dtype=torch.float64).transpose(0, 1)  # [b, 1, V]


def test_plain_softmax_and_temperature():
    logits = _logits([1.0, 2.0, 3.0, 0.0])
    probs = logits_to_probs(logits, [SamplingParams()])
    torch.testing.assert_close(probs, logits.softmax(-1))
    probs_t = logits_to_probs(logits, [SamplingParams(temperature=0.5)])
    torch.testing.assert_close(probs_t, (logits / 0.5).softmax(-1))


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(_logits([1.0, 5.0, 3.0]), [SamplingParams(temperature=0)])
    assert probs.tolist() == [[[0.0, 1.0, 0.0]]]


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]], dtype=torch.float64))
    top_k = logits_to_probs(logits, [SamplingParams(top_k=2)])
    torch.testing.assert_close(top_k[0, 0], torch.tensor([4 / 7, 3 / 7, 0, 0], dtype=torch.float64))
    # top_p = 0.65: 0.4 alone < 0.65, 0.4 + 0.3 >= 0.65 -> keep two tokens.
    top_p = logits_to_probs(logits, [SamplingParams(top_p=0.65)])
    assert (top_p[0, 0] > 0).tolist() == [True, True, False, False]
    # min_p = 0.6: threshold 0.24 -> keep 0.4 and 0.3.
    min_p = logits_to_probs(logits, [SamplingParams(min_p=0.6)])
    assert (min_p[0, 0] > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(min_p.sum(-1), torch.ones(1, 1, dtype=torch.float64))


def test_per_row_parameters_are_vectorised():
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 50)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3), SamplingParams(top_p=0.5)]
    probs = logits_to_probs(logits, params)
    for row, p in enumerate(params):
        torch.testing.assert_close(probs[row:row + 1], logits_to_probs(logits[row:row + 1], [p]))
    assert ((probs[1] > 0).sum(-1) == 3).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3, 2))


def test_shape_errors():
    with pytest.raises(ValueError, match="params"):
        logits_to_probs(torch.zeros(2, 1, 4), [SamplingParams()])
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.zeros(2, 4), [SamplingParams()] * 2)


def test_generator_seeding():
    a = torch.rand(4, generator=make_generator(7))
    b = torch.rand(4, generator=make_generator(7))
    c = torch.rand(4, generator=make_generator(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sample_from_probs_distribution_and_greedy():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    generator = make_generator(0)
    counts = torch.zeros(4)
    num_samples = 20_000
    for _ in range(num_samples):
        counts[sample_from_probs(probs.clone(), [False], [generator])[0]] += 1
    assert counts[3] == 0
    assert torch.allclose(counts / num_samples, probs[0].float(), atol=0.015)
    greedy = sample_from_probs(probs, [True], [generator])
    assert greedy.tolist() == [0]


def test_inverse_cdf_sample_edges_never_pick_zero_weight_tokens():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0],    # mass 3: u < 2/3 -> 1, else 3
                            [0.0, 0.0, 5.0, 0.0, 0.0]], dtype=torch.float32)
    largest_u = 1.0 - 2.0 ** -53                            # u * total may round up to total
    for u, expected in ((0.0, [1, 2]), (0.5, [1, 2]), (0.7, [3, 2]), (largest_u, [3, 2])):
        uniforms = torch.tensor([u, u], dtype=torch.float64)
        assert inverse_cdf_sample(weights, uniforms).tolist() == expected


def test_sample_from_probs_consumes_one_draw_per_sampled_row():
    probs = torch.softmax(torch.randn(3, 50, generator=make_generator(1)), dim=-1)
    gens = [make_generator(5), make_generator(5), make_generator(6)]
    sample_from_probs(probs, [False, True, False], gens)
    after = [torch.rand(1, dtype=torch.float64, generator=g).item() for g in gens]
    expected = [torch.rand(2, dtype=torch.float64, generator=make_generator(5))[1].item(),
                torch.rand(1, dtype=torch.float64, generator=make_generator(5))[0].item(),
                torch.rand(2, dtype=torch.float64, generator=make_generator(6))[1].item()]
    assert after == expected
