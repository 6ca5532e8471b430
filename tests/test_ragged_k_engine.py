"""Ragged per-request k in the engine workers (``specdec.engine.draft_worker``, ``specdec.engine.worker``) and
the in-process ``sd`` / ``psd`` loops (``reference.loop.ReferenceLoop(k_of=...)``): one Draft
and one Verify call hold rows of different k_i, k_i changes between a request's steps, and
greedy output equals the target alone (``ar``) token for token."""

from __future__ import annotations

import pytest
import torch
from test_reference_loops import PROMPTS, _runner, _workers

from reference.loop import LoopConfig, ReferenceLoop, Request
from specdec.sample.sampling import SamplingParams

torch.set_num_threads(1)
K_MAX = 4


def _k_of(request_id: str, num_verified: int) -> int:
    """k_i in [1, K_MAX]: differs across requests and changes every step of a request."""
    return 1 + (int(request_id[1:]) + 3 * num_verified) % K_MAX


def _loop(tiny_llama, mode: str, draft_kind: str | None, params, k_of=None):
    target, drafter = _workers(tiny_llama, draft_kind, max_num_seqs=4)
    widths = []
    verify = target.verify

    def recording_verify(request_ids, draft_token_ids, draft_probs):
        widths.append(sorted({len(row) for row in draft_token_ids}))
        return verify(request_ids, draft_token_ids, draft_probs)

    target.verify = recording_verify
    requests = [Request(f"r{i}", list(p), params) for i, p in enumerate(PROMPTS)]
    ReferenceLoop(LoopConfig(mode, K_MAX, 4), target, drafter, k_of=k_of).run(requests)
    assert target.num_active == 0
    return [r.output_token_ids for r in requests], widths


@pytest.mark.parametrize("draft_kind", ["layer", "other"])
def test_greedy_sd_psd_with_ragged_changing_k_equal_ar(tiny_llama, draft_kind):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference, _ = _loop(tiny_llama, "ar", None, params)
    for mode in ("sd", "psd"):
        outputs, widths = _loop(tiny_llama, mode, draft_kind, params, _k_of)
        assert outputs == reference, mode
        assert sum(len(w) > 1 for w in widths) >= 3, widths   # Verify calls with rows of different k_i
        assert {k for w in widths for k in w} >= {1, 2, 3, 4}


def _pair(tiny_llama, params):
    """Two identical (target, draft) worker pairs with requests a, b added."""
    pairs = []
    for _ in range(2):
        target, drafter = _workers(tiny_llama, "layer", max_num_seqs=4)
        for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[2])):
            target.add_request(rid, prompt, params)
            drafter.add_request(rid, prompt, params)
        pairs.append((target, drafter))
    return pairs


def test_ragged_draft_and_verify_equal_each_row_alone(tiny_llama):
    """Seeded sampled requests: one ragged Draft (k = 3, 1) and one ragged Verify give each
    request the tokens, probs, committed block and KV lengths of calls with its own k alone."""
    params = SamplingParams(temperature=0.9, seed=5)
    (target, drafter), (target_1, drafter_1) = _pair(tiny_llama, params)
    committed = [(len(PROMPTS[0]), []), (len(PROMPTS[2]), [])]
    ids, probs = drafter.draft(["a", "b"], committed, [3, 1])
    assert [len(row) for row in ids] == [3, 1] and probs.shape[:2] == (2, 3)
    assert torch.all(probs[1, 1:] == 0)
    alone = [drafter_1.draft([rid], [c], k_i) for rid, c, k_i in (("a", committed[0], 3), ("b", committed[1], 1))]
    for row, (alone_ids, alone_probs) in enumerate(alone):
        assert ids[row] == alone_ids[0]
        torch.testing.assert_close(probs[row, : len(ids[row])], alone_probs[0])
    assert drafter.runner.seq_len(0) == len(PROMPTS[0]) + 2 and drafter.runner.seq_len(1) == len(PROMPTS[2])
    outputs = target.verify(["a", "b"], ids, probs)
    singles = [target_1.verify([rid], [ids[row]], probs[row: row + 1, : len(ids[row])])[0]
               for row, rid in enumerate(("a", "b"))]
    for out, single in zip(outputs, singles):
        assert (out.token_ids, out.num_accepted) == (single.token_ids, single.num_accepted)
        assert out.logprobs == pytest.approx(single.logprobs)
    for slot in (0, 1):
        assert target.runner.seq_len(slot) == target_1.runner.seq_len(slot)


def test_ragged_verify_feeds_only_real_tokens(tiny_llama):
    """The runner is given k_i + 1 tokens per row, not the padded k + 1."""
    target, _ = _workers(tiny_llama, None, max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        target.add_request(rid, prompt, greedy)
    fed = []
    forward = target.runner.forward
    target.runner.forward = lambda slots, token_ids, *a: fed.append([len(t) for t in token_ids]) or forward(slots, token_ids, *a)
    target.verify(["a", "b"], [[3, 4, 5], [6]], None)
    assert fed == [[4, 2]]
