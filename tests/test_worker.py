"""Tests for specdec.engine.worker on tiny float64 Llama models against a cache-free reference model."""

from __future__ import annotations

import pytest
import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.models.draft_format import build_draft_from_target
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams
from specdec.engine.worker import DraftCapacityError, DraftWorker, TargetWorker

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41], [1, 7, 100, 3, 3, 3, 90, 12]]


def _runner(tiny_llama, max_model_len=128, max_num_seqs=4, **kwargs):
    model = tiny_llama(dtype=torch.float64, **kwargs)
    return ModelRunner(ModelConfig(dtype="float64"),
                       CacheConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
                       model=model)


def _reference_logits(reference, sequence: list[int]) -> torch.Tensor:
    """Full cache-free forward: logits [len(sequence), V]."""
    with torch.no_grad():
        return reference(input_ids=torch.tensor([sequence])).logits[0]


def _reference_greedy(reference, prompt: list[int], num_tokens: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(num_tokens):
        sequence.append(int(_reference_logits(reference, sequence)[-1].argmax()))
    return sequence[len(prompt):]


def test_target_greedy_decode_matches_reference(tiny_llama):
    worker = TargetWorker(_runner(tiny_llama))
    reference = tiny_llama(dtype=torch.float64)
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    outputs = {r: worker.add_request(r, p, GREEDY).token_ids for r, p in zip(ids, PROMPTS)}
    for _ in range(6):
        for out in worker.verify(ids, [[] for _ in ids], None):
            assert out.num_accepted == 0 and len(out.token_ids) == 1
            outputs[out.request_id] += out.token_ids
    for r, prompt in zip(ids, PROMPTS):
        assert outputs[r] == _reference_greedy(reference, prompt, 7)


def test_verify_accepts_correct_drafts_and_rolls_back_wrong_ones(tiny_llama):
    worker = TargetWorker(_runner(tiny_llama))
    reference = tiny_llama(dtype=torch.float64)
    prompt = PROMPTS[0]
    expected = _reference_greedy(reference, prompt, 12)
    first = worker.add_request("a", prompt, GREEDY)
    assert first.token_ids == expected[:1]
    # all three drafts right -> three accepted + bonus
    out = worker.verify(["a"], [expected[1:4]], None)[0]
    assert out.num_accepted == 3 and out.token_ids == expected[1:5]
    # second draft wrong -> one accepted + the target's token; the KV must forget the bad draft
    wrong = (expected[6] + 1) % 128
    out = worker.verify(["a"], [[expected[5], wrong, expected[7]]], None)[0]
    assert out.num_accepted == 1 and out.token_ids == expected[5:7]
    out = worker.verify(["a"], [[]], None)[0]
    assert out.token_ids == expected[7:8]
    assert worker.runner.seq_len(0) == len(prompt) + 7  # all committed tokens but the pending one
    # logprobs are the model's raw log-softmax at each committed position
    logits = _reference_logits(reference, prompt + expected[:8])
    assert out.logprobs[0] == pytest.approx(float(logits[-2].log_softmax(-1)[expected[7]]),
                                            abs=1e-5)


def test_top_logprobs_of_first_accepted_recovered_and_bonus_tokens_match_plain_forward(tiny_llama):
    worker = TargetWorker(_runner(tiny_llama))
    reference = tiny_llama(dtype=torch.float64)
    prompt, num_top = PROMPTS[2], 5
    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=num_top)
    expected = _reference_greedy(reference, prompt, 6)
    outs = [worker.add_request("a", prompt, params)]
    outs.append(worker.verify(["a"], [expected[1:3]], None)[0])                  # 2 accepted + bonus
    wrong = (expected[4] + 1) % 128
    outs.append(worker.verify(["a"], [[wrong, expected[5]]], None)[0])          # recovered token
    token_ids = [t for out in outs for t in out.token_ids]
    assert token_ids == expected[:5] and [o.num_accepted for o in outs] == [0, 2, 0]
    logprobs = _reference_logits(reference, prompt + token_ids)[len(prompt) - 1: -1].log_softmax(-1)
    pairs = [pair for out in outs for pair in zip(out.logprobs, out.top_logprobs)]
    for pos, (logprob, (top_ids, top_values)) in enumerate(pairs):
        assert logprob == pytest.approx(float(logprobs[pos, token_ids[pos]]), abs=1e-6)
        values, ids = logprobs[pos].topk(num_top)
        assert top_ids == ids.tolist() and top_values == pytest.approx(values.tolist(), abs=1e-6)
    assert worker.add_request("b", prompt, GREEDY).top_logprobs == []  # not asked: not computed


def test_verify_rejects_bad_rows_and_unknown_ids(tiny_llama):
    worker = TargetWorker(_runner(tiny_llama))
    worker.add_request("a", PROMPTS[0], GREEDY)
    worker.add_request("b", PROMPTS[1], GREEDY)
    with pytest.raises(ValueError, match="draft_token_ids has 1 rows"):
        worker.verify(["a", "b"], [[1]], None)
    with pytest.raises(ValueError, match="draft_probs"):
        worker.verify(["a", "b"], [[1], [1, 2]], torch.rand(2, 1, worker.runner.vocab_size))
    with pytest.raises(KeyError):
        worker.verify(["zz"], [[]], None)
    with pytest.raises(ValueError, match="already active"):
        worker.add_request("a", PROMPTS[0], GREEDY)
    worker.release("a")
    assert worker.runner.num_free_slots == 3


def test_draft_worker_greedy_catch_up_matches_reference(tiny_llama):
    draft = DraftWorker(_runner(tiny_llama, num_layers=1, seed=3), target_vocab_size=160)
    reference = tiny_llama(dtype=torch.float64, num_layers=1, seed=3)
    prompt = PROMPTS[2]
    draft.add_request("a", prompt, GREEDY)
    committed = prompt + [11]
    tokens, probs = draft.draft(["a"], [(len(prompt), [11])], k=3)
    assert probs is None
    assert tokens == [_reference_greedy(reference, committed, 3)]
    # the verifier accepted only the first draft and recovered token 50: catch up from there
    committed = committed + [tokens[0][0], 50]
    tokens, _ = draft.draft(["a"], [(len(prompt) + 1, committed[len(prompt) + 1:])], k=4)
    assert tokens == [_reference_greedy(reference, committed, 4)]
    assert draft.runner.seq_len(0) == len(committed) + 3
    # nothing new committed since: the draft must be the same again
    again, _ = draft.draft(["a"], [(len(committed), [])], k=4)
    assert again == tokens


def test_draft_probs_padded_and_sampled_from_q(tiny_llama):
    draft = DraftWorker(_runner(tiny_llama, num_layers=1), target_vocab_size=160)
    params = SamplingParams(temperature=0.8, top_k=5, seed=1)
    draft.add_request("a", PROMPTS[0], params)
    draft.add_request("g", PROMPTS[1], GREEDY)
    tokens, probs = draft.draft(["a", "g"], [(5, [4]), (3, [4])], k=3)
    assert probs.shape == (2, 3, 160) and probs.dtype == torch.float32
    assert torch.all(probs[:, :, 128:] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert ((probs[0] > 0).sum(-1) == 5).all()
    for step, token in enumerate(tokens[0]):
        assert probs[0, step, token] > 0
    for step, token in enumerate(tokens[1]):
        assert probs[1, step, token] == 1.0


def test_reduced_vocab_draft_returns_target_ids_and_probs_zero_outside(tiny_llama):
    target = tiny_llama(dtype=torch.float64)
    vocab_ids = torch.arange(3, 128, 4)                       # 32 of the 128 target ids
    model = build_draft_from_target(target, [0], vocab_ids)
    draft = DraftWorker(ModelRunner(ModelConfig(dtype="float64"), CacheConfig(max_num_seqs=4, max_model_len=128),
                                    model=model))
    assert draft.runner.vocab_size == 32 and draft.target_vocab_size == 128
    draft.add_request("s", PROMPTS[0], SamplingParams(temperature=1.0, seed=2))
    draft.add_request("g", PROMPTS[2], GREEDY)
    tokens, probs = draft.draft(["s", "g"], [(5, [4]), (8, [4])], k=3)
    assert probs.shape == (2, 3, 128) and probs.dtype == torch.float32
    outside = torch.ones(128, dtype=torch.bool)
    outside[vocab_ids] = False
    assert torch.all(probs[:, :, outside] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    allowed = set(vocab_ids.tolist())
    for row, request_tokens in enumerate(tokens):
        for step, token in enumerate(request_tokens):
            assert token in allowed and probs[row, step, token] > 0
    # greedy: the argmax within the subset, mapped to the target id, along the greedy sequence
    sequence = PROMPTS[2] + [4]
    with torch.no_grad():
        for token in tokens[1]:
            logits = model(input_ids=torch.tensor([sequence])).logits[0, -1]
            assert token == int(vocab_ids[logits.argmax()])
            sequence.append(token)


def test_draft_capacity_error_before_state_change(tiny_llama):
    draft = DraftWorker(_runner(tiny_llama, max_model_len=10))
    draft.add_request("a", PROMPTS[0], GREEDY)
    assert draft.can_draft(8, 3) and not draft.can_draft(9, 3)
    with pytest.raises(DraftCapacityError) as info:
        draft.draft(["a"], [(5, [1, 2, 3, 4])], k=3)
    assert info.value.request_ids == ["a"]
    assert draft.runner.seq_len(0) == 5
    tokens, _ = draft.draft(["a"], [(5, [1, 2, 3])], k=3)
    assert len(tokens[0]) == 3


def test_draft_bad_committed_ids_refused_before_state_change(tiny_llama):
    """A committed token id outside the vocab (here two new tokens, the second bad) is refused
    before any state changes; the request then drafts as if the bad call never happened (it
    used to keep a KV shorter than its token list: every later call failed)."""
    reference, draft = DraftWorker(_runner(tiny_llama)), DraftWorker(_runner(tiny_llama))
    for worker in (reference, draft):
        worker.add_request("a", PROMPTS[0], GREEDY)
        worker.add_request("b", PROMPTS[1], GREEDY)
    vocab_size = draft.runner.input_vocab_size
    messages = []
    for bad in (-1, vocab_size):
        with pytest.raises(ValueError) as info:
            draft.draft(["b", "a"], [(3, [2]), (5, [4, bad])], k=[1, 2])
        messages.append(str(info.value))
    assert draft.runner.seq_len(0) == len(PROMPTS[0]) and draft.runner.seq_len(1) == len(PROMPTS[1])
    committed = [(3, [2, 6]), (5, [4, 8])]
    assert draft.draft(["b", "a"], committed, k=[3, 2]) == reference.draft(["b", "a"], committed, k=[3, 2])
    assert all("committed token ids of ['a']" in message for message in messages)


def test_unseeded_requests_reproducible_with_worker_seed(tiny_llama):
    def run(seed):
        worker = TargetWorker(_runner(tiny_llama), seed=seed)
        first = worker.add_request("a", PROMPTS[0], SamplingParams(temperature=1.0))
        outs = [worker.verify(["a"], [[]], None)[0].token_ids[0] for _ in range(8)]
        return first.token_ids + outs

    assert run(5) == run(5)
    assert run(5) != run(6)
