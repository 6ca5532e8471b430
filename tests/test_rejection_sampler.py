"""Tests for specdec.sample.rejection (ladder after vLLM's tests/v1/sample/test_rejection_sampler.py).

``reference_rejection_sample`` below is a plain, loop-per-token transcription of Leviathan et al.
2023, Algorithm 1 that consumes each row's generator in the documented order (k + 1 uniforms: k acceptance tests,
then one located in the final distribution's cumulative sum); the batched implementation must agree with it token for token.
"""

from __future__ import annotations

import pytest
import torch

from specdec.sample.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from specdec.sample.sampling import SamplingParams, logits_to_probs, make_generator

torch.set_num_threads(1)


def reference_rejection_sample(draft_ids, draft_probs, target_probs, is_greedy, generators):
    batch_size, k = draft_ids.shape
    vocab_size = target_probs.shape[-1]
    out = torch.full((batch_size, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    num_accepted = torch.zeros(batch_size, dtype=torch.int64)
    for row in range(batch_size):
        p = target_probs[row].double()
        if is_greedy[row]:
            a = 0
            while a < k and int(draft_ids[row, a]) == int(p[a].argmax()):
                out[row, a] = draft_ids[row, a]
                a += 1
            out[row, a] = p[a].argmax()
            num_accepted[row] = a
            continue
        u = torch.rand(k + 1, dtype=torch.float64, generator=generators[row])
        if draft_probs is None:
            q = torch.nn.functional.one_hot(draft_ids[row], vocab_size).double()
        else:
            q = draft_probs[row].double()
        a = 0
        final = p[k]
        while a < k:
            d = int(draft_ids[row, a])
            if u[a] < min(1.0, float(p[a, d] / q[a, d])):
                out[row, a] = d
                a += 1
                continue
            residual = torch.clamp(p[a] - q[a], min=0)
            final = residual if residual.sum() > 0 else p[a]
            break
        running, threshold = 0.0, float(u[k]) * float(final.sum())
        for token, weight in enumerate(final.tolist()):   # first token whose cumulative mass passes u
            running += weight
            if running > threshold:
                break
        out[row, a] = token
        num_accepted[row] = a
    return out, num_accepted


def _one_hot_probs(token_ids: list[list[int]], vocab_size: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token_ids), vocab_size).float()


def _greedy(draft, target, vocab_size=8):
    draft_ids = torch.tensor(draft, dtype=torch.int64)
    target_probs = _one_hot_probs(target, vocab_size)
    batch_size = draft_ids.shape[0]
    return rejection_sample(draft_ids, None, target_probs, torch.ones(batch_size, dtype=torch.bool),
                            [make_generator(0) for _ in range(batch_size)])


def test_greedy_perfect_match_emits_bonus():
    out, num_accepted = _greedy([[1, 2, 3]], [[1, 2, 3, 4]])
    assert out.tolist() == [[1, 2, 3, 4]] and num_accepted.tolist() == [3]


def test_greedy_early_mismatch_pads_with_placeholder():
    out, num_accepted = _greedy([[1, 5, 3], [7, 2, 3]], [[1, 2, 3, 4], [1, 2, 3, 4]])
    assert out.tolist() == [[1, 2, -1, -1], [1, -1, -1, -1]]
    assert num_accepted.tolist() == [1, 0]


def test_empty_draft_is_plain_decode():
    out, num_accepted = _greedy([[]], [[6]])
    assert out.tolist() == [[6]] and num_accepted.tolist() == [0]
    target = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]])
    out, _ = rejection_sample(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, 4), target,
                              torch.zeros(1, dtype=torch.bool), [make_generator(3)])
    assert out.tolist() == [[2]]


def test_shape_checks():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    target = torch.rand(2, 4, 8)
    greedy = torch.zeros(2, dtype=torch.bool)
    gens = [make_generator(0), make_generator(1)]
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(ids, None, torch.rand(2, 3, 8), greedy, gens)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(ids, torch.rand(2, 3, 9), target, greedy, gens)
    with pytest.raises(ValueError, match="is_greedy"):
        rejection_sample(ids, None, target, torch.zeros(3, dtype=torch.bool), gens)
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(ids, None, target, greedy, gens[:1])
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(ids.int(), None, target, greedy, gens)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(ids + 8, None, target, greedy, gens)


def _random_case(batch_size, k, vocab_size, seed):
    torch.manual_seed(seed)
    draft_probs = torch.rand(batch_size, k, vocab_size).pow(3).softmax(-1)
    target_probs = torch.rand(batch_size, k + 1, vocab_size).pow(3).softmax(-1)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab_size), 1).view(batch_size, k)
    return draft_ids, draft_probs, target_probs


@pytest.mark.parametrize("seed", range(5))
def test_fast_path_matches_reference(seed):
    batch_size, k, vocab_size = 6, 4, 16
    draft_ids, draft_probs, target_probs = _random_case(batch_size, k, vocab_size, seed)
    # make some drafts agree with p's argmax so greedy rows accept a few
    draft_ids[:, :2] = target_probs[:, :2].argmax(-1)
    is_greedy = torch.tensor([True, False, False, True, False, False])
    for probs in (draft_probs, None):
        fast = rejection_sample(draft_ids, probs, target_probs, is_greedy,
                                [make_generator(seed * 10 + i) for i in range(batch_size)])
        ref = reference_rejection_sample(draft_ids, probs, target_probs, is_greedy,
                                         [make_generator(seed * 10 + i) for i in range(batch_size)])
        assert fast[0].tolist() == ref[0].tolist()
        assert fast[1].tolist() == ref[1].tolist()


def test_seeded_determinism_and_batch_independence():
    draft_ids, draft_probs, target_probs = _random_case(4, 3, 32, seed=11)
    is_greedy = torch.zeros(4, dtype=torch.bool)
    first = rejection_sample(draft_ids, draft_probs, target_probs, is_greedy,
                             [make_generator(s) for s in range(4)])
    again = rejection_sample(draft_ids, draft_probs, target_probs, is_greedy,
                             [make_generator(s) for s in range(4)])
    assert torch.equal(first[0], again[0])
    alone = rejection_sample(draft_ids[2:3], draft_probs[2:3], target_probs[2:3],
                             is_greedy[2:3], [make_generator(2)])
    assert torch.equal(alone[0][0], first[0][2])


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_sampled_tokens_converge_to_target_distribution():
    """Every committed token is marginally ~ p when p, q are the same at every position."""
    vocab_size, k, num_samples = 8, 2, 100_000
    torch.manual_seed(0)
    p = torch.rand(vocab_size).double()
    p = p / p.sum()
    q = torch.rand(vocab_size).double()
    q = q / q.sum()
    generator = make_generator(1234)
    draft_ids = torch.multinomial(q, num_samples * k, replacement=True,
                                  generator=generator).view(num_samples, k)
    out, _ = rejection_sample(draft_ids, q.expand(num_samples, k, vocab_size),
                              p.expand(num_samples, k + 1, vocab_size),
                              torch.zeros(num_samples, dtype=torch.bool),
                              [generator] * num_samples)
    first_tokens = out[:, 0]  # the first committed token of every row is always present
    distances = {}
    for n in (10, 100, 1_000, 10_000, 100_000):
        hist = torch.bincount(first_tokens[:n], minlength=vocab_size).double() / n
        distances[n] = _tv(hist, p)
    assert distances[100_000] < 0.01
    assert distances[100_000] < distances[1_000] < distances[10]
    hist = torch.bincount(out[out != PLACEHOLDER_TOKEN_ID], minlength=vocab_size).double()
    hist = hist / hist.sum()
    assert _tv(hist, p) < 0.01
    for seed in range(100, 105):
        random_ref = torch.rand(vocab_size, generator=make_generator(seed)).double()
        assert _tv(hist, random_ref / random_ref.sum()) > 10 * _tv(hist, p)


@pytest.mark.parametrize("params", [SamplingParams(top_k=3), SamplingParams(top_p=0.4),
                                    SamplingParams(top_k=5, top_p=0.7, min_p=0.1)])
def test_samples_stay_inside_top_k_top_p_mask(params):
    batch_size, k, vocab_size = 256, 3, 20
    torch.manual_seed(5)
    target_probs = logits_to_probs(torch.randn(batch_size, k + 1, vocab_size) * 2,
                                   [params] * batch_size)
    draft_probs = logits_to_probs(torch.randn(batch_size, k, vocab_size) * 2,
                                  [params] * batch_size)
    generator = make_generator(9)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab_size), 1, generator=generator)
    out, num_accepted = rejection_sample(draft_ids.view(batch_size, k), draft_probs, target_probs,
                                         torch.zeros(batch_size, dtype=torch.bool),
                                         [generator] * batch_size)
    for row in range(batch_size):
        a = int(num_accepted[row])
        final = int(out[row, a])
        assert target_probs[row, a, final] > 0, "recovered/bonus token outside the target mask"
        for pos in range(a):
            assert target_probs[row, pos, out[row, pos]] > 0, "accepted token outside the mask"
