"""Row-wise slot attention (the CPU default) and last-token prefill logits (issue 8 CPU speed-ups)
must give what the batched layout and a full-logits forward give."""

from __future__ import annotations

import pytest
import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.kv.kv_cache import SlotKVCache
from specdec.engine.runner import ModelRunner

MAX_MODEL_LEN = 64
F64 = torch.float64  # logits dtype: the float64 model's full precision
PROMPT_LENS = (5, 17, 9, 30)       # ragged contexts


def make_runner(tiny_llama, max_num_seqs: int = 4) -> ModelRunner:
    return ModelRunner(ModelConfig(model="tiny", dtype="float64"),
                       CacheConfig(max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN),
                       model=tiny_llama(dtype=torch.float64))


def tokens(num: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (num,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(tiny_llama) -> tuple[ModelRunner, list[int]]:
    runner = make_runner(tiny_llama)
    slots = [runner.allocate_slot() for _ in PROMPT_LENS]
    for slot, length in zip(slots, PROMPT_LENS):
        runner.prefill([slot], [tokens(length, seed=slot)])
    return runner, slots


def test_rowwise_is_the_cpu_default_and_can_be_turned_off():
    args = dict(num_layers=1, max_num_seqs=2, max_model_len=8, num_kv_heads=1, head_dim=4,
                dtype=torch.float32, device="cpu")
    assert SlotKVCache(**args).is_rowwise
    assert not SlotKVCache(**args, is_rowwise=False).is_rowwise
    with pytest.raises(ValueError, match="num_query_groups"):
        SlotKVCache(**args, num_query_groups=0)


@pytest.mark.parametrize("row_lens", [(1, 1, 1, 1), (3, 1, 4, 2), (5, 5, 5, 5)])
def test_rowwise_equals_batched_for_ragged_rows_and_unordered_slots(tiny_llama, row_lens):
    """Decode (q = 1) and verify steps with padding, slots in descending (gathered) order."""
    runner, slots = prefilled(tiny_llama)
    order = slots[::-1]
    rows = [tokens(n, seed=100 + i) for i, n in enumerate(row_lens)]
    lens = [runner.seq_len(s) for s in order]
    logits = {}
    for is_rowwise in (False, True):
        runner.cache.is_rowwise = is_rowwise
        logits[is_rowwise] = runner.forward(order, rows, F64)
        after = [runner.seq_len(s) for s in order]
        assert after == [n + len(r) for n, r in zip(lens, rows)]
        nxt = runner.forward(order, [[7]] * len(order), F64)          # reads what the step wrote
        logits[is_rowwise] = (logits[is_rowwise], nxt)
        for slot, length in zip(order, lens):
            runner.truncate(slot, length)
    for (step_a, next_a), (step_b, next_b) in [(logits[False], logits[True])]:
        for row, n in enumerate(row_lens):                       # real tokens only
            torch.testing.assert_close(step_a[row, :n], step_b[row, :n], rtol=0, atol=1e-10)
        torch.testing.assert_close(next_a, next_b, rtol=0, atol=1e-10)


def test_rowwise_decode_matches_cache_free_forward(tiny_llama):
    runner, slots = prefilled(tiny_llama)
    reference = tiny_llama(dtype=torch.float64)
    step = runner.forward(slots[::-1], [[11]] * len(slots), F64)      # [b, 1, V]
    for row, slot in enumerate(slots[::-1]):
        full = tokens(PROMPT_LENS[slot], seed=slot) + [11]
        with torch.no_grad():
            expected = reference(torch.tensor([full])).logits[0, -1]
        torch.testing.assert_close(step[row, 0], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("lengths", [(12,), (4, 9, 9, 1)])
def test_prefill_last_token_logits_equal_full_forward(tiny_llama, lengths):
    prompts = [tokens(n, seed=n + i) for i, n in enumerate(lengths)]
    runner = make_runner(tiny_llama)
    slots = [runner.allocate_slot() for _ in prompts]
    last = runner.prefill(slots, prompts, F64)                        # [b, V], LM head on last only
    assert last.shape == (len(prompts), runner.vocab_size)
    assert [runner.seq_len(s) for s in slots] == list(lengths)
    for slot in slots:
        runner.truncate(slot, 0)
    full = runner.forward(slots, prompts, F64)                        # [b, q_max, V]
    expected = full[torch.arange(len(prompts)), torch.tensor([n - 1 for n in lengths])]
    torch.testing.assert_close(last, expected, rtol=0, atol=1e-10)
