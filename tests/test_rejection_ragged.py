"""Ragged rows of the rejection sampler (``specdec.sample.rejection``, ``num_draft_tokens``): row i
verifies its own k_i <= k drafts; padding past k_i is never read; the bonus token comes from
p_{k_i+1}; each sampled row draws k_i + 1 uniforms (module docstring), so a ragged row equals the
rectangular call on that row cut to k_i columns, and the output follows the target (Leviathan et
al. 2023, Theorem 1)."""

from __future__ import annotations

import pytest
import torch
from test_rejection_sampler import _one_hot_probs, _random_case, _tv, reference_rejection_sample

from specdec.sample.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from specdec.sample.sampling import make_generator
from specdec.engine.worker import greedy_verify

torch.set_num_threads(1)


def _ks(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_greedy_short_row_takes_its_bonus_from_its_own_next_position():
    """Row 1 has k_i = 1 among rows of k = 3: after its one accepted draft its bonus is p_2's
    argmax (position 1), not a draft at position 1 and not p_4; padding holds junk ids."""
    draft = torch.tensor([[1, 2, 3], [1, 7, 7], [5, 5, 5]])
    target = _one_hot_probs([[1, 2, 3, 4], [1, 6, 3, 4], [0, 0, 0, 0]], 8)
    greedy = torch.ones(3, dtype=torch.bool)
    out, num_accepted = rejection_sample(draft, None, target, greedy, [make_generator(0)] * 3, _ks(3, 1, 0))
    assert out.tolist() == [[1, 2, 3, 4], [1, 6, -1, -1], [0, -1, -1, -1]]
    assert num_accepted.tolist() == [3, 1, 0]
    fast_out, fast_accepted = greedy_verify(draft, target.log(), _ks(3, 1, 0))
    assert fast_out.tolist() == out.tolist() and fast_accepted.tolist() == num_accepted.tolist()


def test_padding_is_never_read():
    """Out-of-vocabulary padding ids, NaN padded probs: the real rows' result is unchanged."""
    draft_ids, draft_probs, target_probs = _random_case(3, 4, 16, seed=3)
    ks = _ks(4, 2, 1)
    junk_ids, junk_q, junk_p = draft_ids.clone(), draft_probs.clone(), target_probs.clone()
    for row, k_i in enumerate(ks.tolist()):
        junk_ids[row, k_i:] = PLACEHOLDER_TOKEN_ID
        junk_q[row, k_i:] = float("nan")
        junk_p[row, k_i + 1:] = float("nan")
    greedy = torch.zeros(3, dtype=torch.bool)
    clean = rejection_sample(draft_ids, draft_probs, target_probs, greedy, [make_generator(i) for i in range(3)], ks)
    junk = rejection_sample(junk_ids, junk_q, junk_p, greedy, [make_generator(i) for i in range(3)], ks)
    assert torch.equal(clean[0], junk[0]) and torch.equal(clean[1], junk[1])


@pytest.mark.parametrize("seed", range(6))
def test_ragged_rows_equal_each_row_cut_to_its_own_k(seed):
    """Fast ragged path vs the plain reference run row by row on the rectangular [1, k_i] case,
    same generator seeds: same tokens, same accepted counts, same generator state after."""
    batch_size, k, vocab_size = 6, 4, 16
    draft_ids, draft_probs, target_probs = _random_case(batch_size, k, vocab_size, seed)
    draft_ids[:, :2] = target_probs[:, :2].argmax(-1)
    is_greedy = torch.tensor([True, False, False, True, False, False])
    ks = torch.tensor([(seed + row) % (k + 1) for row in range(batch_size)], dtype=torch.int64)
    for probs in (draft_probs, None):
        generators = [make_generator(seed * 10 + row) for row in range(batch_size)]
        out, num_accepted = rejection_sample(draft_ids, probs, target_probs, is_greedy, generators, ks)
        for row, k_i in enumerate(ks.tolist()):
            alone = make_generator(seed * 10 + row)
            ref_out, ref_accepted = reference_rejection_sample(
                draft_ids[row:row + 1, :k_i], None if probs is None else probs[row:row + 1, :k_i],
                target_probs[row:row + 1, :k_i + 1], is_greedy[row:row + 1], [alone])
            assert out[row, :k_i + 1].tolist() == ref_out[0].tolist(), (row, k_i)
            assert set(out[row, k_i + 1:].tolist()) <= {PLACEHOLDER_TOKEN_ID}
            assert int(num_accepted[row]) == int(ref_accepted[0]) <= k_i
            assert torch.equal(generators[row].get_state(), alone.get_state())  # k_i + 1 draws, no more


def test_seeded_ragged_rows_are_reproducible_and_batch_invariant():
    draft_ids, draft_probs, target_probs = _random_case(4, 3, 32, seed=11)
    is_greedy, ks = torch.zeros(4, dtype=torch.bool), _ks(3, 1, 0, 2)
    first = rejection_sample(draft_ids, draft_probs, target_probs, is_greedy, [make_generator(s) for s in range(4)], ks)
    again = rejection_sample(draft_ids, draft_probs, target_probs, is_greedy, [make_generator(s) for s in range(4)], ks)
    assert torch.equal(first[0], again[0])
    # row 3 (k_i = 2) alone in a batch of width 2: the same tokens as in the width-3 batch
    alone = rejection_sample(draft_ids[3:, :2], draft_probs[3:, :2], target_probs[3:, :3], is_greedy[3:],
                             [make_generator(3)], _ks(2))
    assert alone[0][0].tolist() == first[0][3, :3].tolist()


def test_ragged_sampled_tokens_converge_to_the_target():
    """Every row's first committed token is ~ p_1 whatever its k_i (drafts ~ q != p), and the bonus
    of a fully accepted short row is ~ p_{k_i+1}: chi-square-sized TV bounds at 120k samples."""
    vocab_size, k, num_samples = 8, 3, 120_000
    gen = make_generator(7)
    p = torch.rand(k + 1, vocab_size, generator=gen).double() + 0.05
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(k, vocab_size, generator=gen).double() + 0.05
    q = q / q.sum(-1, keepdim=True)
    draft_ids = torch.stack([torch.multinomial(q[j], num_samples, replacement=True, generator=gen)
                             for j in range(k)], dim=1)
    ks = torch.arange(num_samples, dtype=torch.int64) % (k + 1)           # k_i = 0, 1, 2, 3 in turn
    out, num_accepted = rejection_sample(draft_ids, q.expand(num_samples, k, vocab_size),
                                         p.expand(num_samples, k + 1, vocab_size),
                                         torch.zeros(num_samples, dtype=torch.bool), [gen] * num_samples, ks)
    assert bool((num_accepted <= ks).all())
    for k_i in range(k + 1):
        rows = ks == k_i
        hist = torch.bincount(out[rows, 0], minlength=vocab_size).double() / int(rows.sum())
        assert _tv(hist, p[0]) < 0.015, k_i
    short = (ks == 1) & (num_accepted == 1)   # bonus rows of k_i = 1: token at position 1 ~ p_2
    hist = torch.bincount(out[short, 1], minlength=vocab_size).double() / int(short.sum())
    assert _tv(hist, p[1]) < 0.03 and _tv(hist, p[3]) > 0.05


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1, 2], dtype=torch.int64), r"num_draft_tokens must be int64 \[3\]"),
    (torch.tensor([1, 2, 3], dtype=torch.int32), r"num_draft_tokens must be int64"),
    (torch.tensor([[1, 2, 3]], dtype=torch.int64), r"num_draft_tokens must be int64 \[3\]"),
    (torch.tensor([1, 4, 0], dtype=torch.int64), r"num_draft_tokens must lie in \[0, k=3\]"),
    (torch.tensor([1, -1, 0], dtype=torch.int64), r"num_draft_tokens must lie in \[0, k=3\]"),
])
def test_bad_num_draft_tokens_raise(bad, match):
    ids = torch.zeros(3, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        rejection_sample(ids, None, torch.rand(3, 4, 8), torch.zeros(3, dtype=torch.bool),
                         [make_generator(i) for i in range(3)], bad)


def test_real_draft_ids_are_still_range_checked():
    ids = torch.tensor([[1, 9], [1, 9]])
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(ids, None, torch.rand(2, 3, 8), torch.zeros(2, dtype=torch.bool),
                         [make_generator(0)] * 2, _ks(2, 1))
    rejection_sample(ids, None, torch.rand(2, 3, 8), torch.zeros(2, dtype=torch.bool),
                     [make_generator(0)] * 2, _ks(1, 1))  # the 9s are padding now
