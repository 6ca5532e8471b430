"""``specdec.engine.worker.greedy_verify`` (the all-greedy fast path of TargetWorker.verify, issue 8)
must commit exactly the tokens of the full rejection sampler on one-hot target probabilities."""

from __future__ import annotations

import pytest
import torch

from specdec.sample.rejection import rejection_sample
from specdec.sample.sampling import SamplingParams, logits_to_probs
from specdec.engine.worker import greedy_verify

VOCAB = 50


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_verify_equals_rejection_sampler(k, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = 6
    logits = torch.randn(batch, k + 1, VOCAB, generator=gen)
    target = logits.argmax(-1)
    draft = torch.randint(0, VOCAB, (batch, k), generator=gen)
    for row in range(batch):               # row r copies the target's first r tokens: a = r .. k
        num_copied = min(row, k)
        draft[row, :num_copied] = target[row, :num_copied]
        if num_copied < k:                 # then a sure mismatch
            draft[row, num_copied] = (target[row, num_copied] + 1) % VOCAB
    params = [SamplingParams(temperature=0.0)] * batch
    probs = logits_to_probs(logits, params)
    expected = rejection_sample(draft, None, probs, torch.ones(batch, dtype=torch.bool),
                                [torch.Generator() for _ in range(batch)])
    got = greedy_verify(draft, logits)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[1].tolist() == [min(row, k) for row in range(batch)]
