"""The batched attention layout (what the CUDA dynamic path uses; CPU twin with
``cache.is_rowwise = False``): ``SlotKVCache.prepare`` gives ``CAUSAL_MASK`` only when every row is
a whole prompt in an empty slot without padding, otherwise a mask built once per forward on the
cache's device and folded for the G query heads of a KV head; both paths reproduce a cache-free
forward (float64)."""

from __future__ import annotations

import pytest
import torch
from test_kv_cache import full_logits, random_tokens

from specdec.config import CacheConfig, ModelConfig
from specdec.kv.kv_cache import SlotKVCache
from specdec.kv.kv_metadata import CAUSAL_MASK
from specdec.engine.runner import ModelRunner


def _runner(tiny_llama) -> ModelRunner:
    runner = ModelRunner(ModelConfig(model="tiny", dtype="float64"), CacheConfig(max_num_seqs=4, max_model_len=64),
                         model=tiny_llama(dtype=torch.float64))
    runner.cache.is_rowwise = False
    return runner


def _cache(num_query_groups: int = 3) -> SlotKVCache:
    return SlotKVCache(num_layers=1, max_num_seqs=4, max_model_len=32, num_kv_heads=1, head_dim=4,
                       dtype=torch.float32, device="cpu", num_query_groups=num_query_groups, is_rowwise=False)


def test_causal_only_for_whole_unpadded_prompts_in_empty_slots():
    cache = _cache()
    assert cache.prepare([0], [5], 5).attn_mask == CAUSAL_MASK
    assert cache.prepare([0, 1], [5, 5], 5).attn_mask == CAUSAL_MASK
    padded = cache.prepare([0, 1], [5, 3], 5).attn_mask                       # ragged: row 1 padded
    assert isinstance(padded, torch.Tensor) and padded.shape == (2, 1, 3 * 5, 5)
    cache.commit([0], [5])
    continued = cache.prepare([0], [3], 3).attn_mask                          # slot 0 holds 5 tokens
    assert isinstance(continued, torch.Tensor) and continued.shape == (1, 1, 3 * 3, 8)
    decode = cache.prepare([0], [1], 1).attn_mask
    assert isinstance(decode, torch.Tensor) and decode.shape == (1, 1, 3, 6)


def test_mask_is_folded_per_query_group_and_causal_within_each_row():
    cache = _cache(num_query_groups=2)
    cache.commit([1], [2])                                                    # slot 1: 2 cached tokens
    mask = cache.prepare([0, 1], [3, 1], 3).attn_mask                         # [2, 1, 2 * 3, kv_len 3]
    want_row0 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)   # prompt of 3: causal
    want_row1 = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)   # positions 2..4 over 3 keys
    assert torch.equal(mask[0, 0], torch.cat([want_row0, want_row0]))        # row g * q + t is token t
    assert torch.equal(mask[1, 0, :3], want_row1[:3]) and torch.equal(mask[1, 0, 3:], mask[1, 0, :3])


@pytest.mark.parametrize("prompt_lens", [[9], [6, 6], [9, 4, 7]], ids=["one", "equal", "ragged"])
def test_batched_layout_prefill_and_decode_match_a_cache_free_forward(tiny_llama, prompt_lens):
    runner, reference = _runner(tiny_llama), tiny_llama(dtype=torch.float64)
    seqs = [random_tokens(24, seed=10 + i) for i in range(len(prompt_lens))]
    slots = [runner.allocate_slot() for _ in seqs]
    last = runner.prefill(slots, [s[:n] for s, n in zip(seqs, prompt_lens)], torch.float64)
    refs = [full_logits(reference, s) for s in seqs]
    for i, n in enumerate(prompt_lens):
        assert (last[i] - refs[i][n - 1]).abs().max() < 1e-10
    for step in range(3):                                                     # then 2 tokens a step (mask path)
        fed = [s[n + 2 * step: n + 2 * step + 2] for s, n in zip(seqs, prompt_lens)]
        logits = runner.forward(slots, fed, torch.float64)
        for i, n in enumerate(prompt_lens):
            for t in range(2):
                assert (logits[i, t] - refs[i][n + 2 * step + t]).abs().max() < 1e-10


def test_grouped_attention_refuses_an_unfolded_mask():
    from specdec.kv.slot_attention import _grouped_attention
    query, kv = torch.zeros(1, 4, 3, 2), torch.zeros(1, 2, 3, 2)              # G = 2
    with pytest.raises(ValueError, match="folded"):
        _grouped_attention(query, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool), None)
