"""Presence / frequency / repetition penalties (issue 25, features): the definitions
(``specdec.sample.penalties`` against a per-token reference), validation, exactness under speculation
(greedy sd = psd = ar; the sampled law of the first two tokens equals the penalised target's),
seeds, and rows without penalties untouched bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.sample.penalties import apply_penalties
from specdec.sample.sampling import SamplingParams, logits_to_probs

from test_reference_loops import PROMPTS, _run, _tv

torch.set_num_threads(1)

PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.6, repetition_penalty=1.8)


def _reference(logits: torch.Tensor, prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    """[V] logits penalised token by token (vLLM's definitions)."""
    out = logits.clone()
    for token in range(out.shape[0]):
        count = list(output).count(token)
        if token in prompt or count:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        out[token] -= frequency * count + presence * (count > 0)
    return out


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"), ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"), ({"repetition_penalty": math.nan}, "repetition_penalty"),
])
def test_penalty_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01)


def test_penalties_match_the_definitions_at_every_draft_position():
    """Position j counts the output plus d_1..d_j; a ragged row's padding is ignored."""
    logits = torch.randn(3, 4, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    params = [SamplingParams(**PENALTIES), SamplingParams(), SamplingParams(frequency_penalty=-1.0)]
    histories = [([1, 2], [3, 3, 4]), None, ([5], [])]
    drafts = [[4, 7, 3], [1, 1, 1], [6]]
    out = apply_penalties(logits, params, histories, drafts)
    assert torch.equal(out[1], logits[1])
    for row, (prompt, output) in ((0, histories[0]), (2, histories[2])):
        p = params[row]
        for j in range(1 + len(drafts[row])):
            expected = _reference(logits[row, j], prompt, output + drafts[row][:j], p.presence_penalty,
                                  p.frequency_penalty, p.repetition_penalty)
            torch.testing.assert_close(out[row, j], expected, rtol=0, atol=1e-12)


def test_penalties_on_a_reduced_draft_vocabulary_use_the_target_ids():
    vocab_ids = torch.tensor([0, 2, 5, 9])                      # column -> target id
    logits = torch.ones(1, 1, 4, dtype=torch.float64)
    out = apply_penalties(logits, [SamplingParams(presence_penalty=1.0)], [([], [5, 9, 9, 3])], vocab_ids=vocab_ids)
    assert out[0, 0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_rows_without_penalties_are_bit_identical_next_to_penalised_rows():
    logits = torch.randn(4, 3, 4096, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(**PENALTIES), SamplingParams(top_p=0.9), SamplingParams(**PENALTIES)]
    histories = [None, ([1, 2], [3]), None, ([7], [8, 8])]
    batched = logits_to_probs(apply_penalties(logits, params, histories, [[5, 6]] * 4), params)
    for row in (0, 2):
        assert torch.equal(batched[row], logits_to_probs(logits[row:row + 1], [params[row]])[0])


@pytest.mark.parametrize("draft_kind", ["layer", "same", "subset"])
def test_greedy_sd_and_psd_with_penalties_equal_ar(tiny_llama, draft_kind):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, **PENALTIES)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ar, _ = _run(tiny_llama, "ar", None, PROMPTS, params)
    ar_plain, _ = _run(tiny_llama, "ar", None, PROMPTS, plain)
    assert sum(a.output_token_ids != b.output_token_ids for a, b in zip(ar, ar_plain)) >= len(PROMPTS) // 2
    for mode in ("sd", "psd"):
        spec, stats = _run(tiny_llama, mode, draft_kind, PROMPTS, params)
        assert [s.output_token_ids for s in spec] == [a.output_token_ids for a in ar], (mode, draft_kind)
        if draft_kind == "same":          # the draft is penalised exactly as the target
            assert stats.mean_acceptance_length == 4.0


def _exact_first_two_penalised(tiny_llama, prompt, vocab_size, penalties):
    """The penalised target's exact joint law of the first two tokens, [V, V], at temperature 1."""
    model = tiny_llama(dtype=torch.float64, vocab_size=vocab_size)
    args = (penalties["presence_penalty"], penalties["frequency_penalty"], penalties["repetition_penalty"])
    with torch.no_grad():
        first = _reference(model(input_ids=torch.tensor([prompt])).logits[0, -1], prompt, [], *args).softmax(-1)
        logits = model(input_ids=torch.tensor([prompt + [t] for t in range(vocab_size)])).logits[:, -1]
    second = torch.stack([_reference(logits[t], prompt, [t], *args).softmax(-1) for t in range(vocab_size)])
    return first.unsqueeze(1) * second


def test_sampled_sd_psd_with_penalties_follow_the_penalised_target(tiny_llama):
    vocab_size, num_samples, prompt = 8, 1500, [1, 5, 3]
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=2.0)
    exact = _exact_first_two_penalised(tiny_llama, prompt, vocab_size, penalties)
    unpenalised = _exact_first_two_penalised(tiny_llama, prompt, vocab_size,
                                             dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0))
    assert _tv(exact, unpenalised) > 0.2                       # the penalties matter here
    params = [SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=s, **penalties)
              for s in range(num_samples)]
    for mode in ("sd", "psd"):             # ar's penalties: the definition test above
        requests, _ = _run(tiny_llama, mode, "other", [prompt] * num_samples, params, k=2, max_num_seqs=512,
                           vocab_size=vocab_size)
        counts = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        for r in requests:
            counts[r.output_token_ids[0], r.output_token_ids[1]] += 1
        assert _tv(counts / num_samples, exact) < 0.08, mode            # 0.06 here; unpenalised: 0.62
        # chi-square of the first token's histogram (8 cells, 7 dof; 24.3 is the 0.1% quantile)
        expected = exact.sum(1) * num_samples
        assert float(((counts.sum(1) - expected) ** 2 / expected).sum()) < 24.3, mode


def test_seeded_request_with_penalties_is_reproducible_and_batch_invariant(tiny_llama):
    seeded = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=42, **PENALTIES)
    alone, _ = _run(tiny_llama, "psd", "layer", [PROMPTS[0]], [seeded])
    again, _ = _run(tiny_llama, "psd", "layer", [PROMPTS[0]], [seeded])
    others = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=i, top_k=5 * (i % 2))
              for i, m in enumerate([5, 9, 16, 3])]
    crowd, _ = _run(tiny_llama, "psd", "layer", PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:5],
                    others[:2] + [seeded] + others[2:], max_num_seqs=3)
    assert again[0].output_token_ids == alone[0].output_token_ids == crowd[2].output_token_ids
