"""Issue 8 (CPU speed): grouped-query slot attention without K/V repeats, the bfloat16 runner
path, and the benchmark suite's dtype (the same for ours and vLLM)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from bench.cpu.cpu_step_identity import compare
from bench.common.suite import SuiteConfig, parse_args
from bench.common.systems import AUTO_DTYPE, SYSTEMS, VllmSystem, resolve_bench_dtype
from specdec.config import CacheConfig, ModelConfig
from specdec.kv.kv_cache import _grouped_attention
from specdec.engine.runner import ModelRunner



@pytest.mark.parametrize("num_heads,num_kv_heads,q_len", [(9, 3, 1), (9, 3, 5), (4, 4, 3), (4, 1, 2)])
def test_grouped_attention_equals_repeated_kv_reference(num_heads, num_kv_heads, q_len):
    gen = torch.Generator().manual_seed(q_len + num_heads)
    batch, kv_len, head_dim = 3, 11, 8
    query = torch.randn(batch, q_len, num_heads, head_dim, generator=gen, dtype=torch.float64)
    query = query.transpose(1, 2)                        # [b, H, q, d], non-contiguous as in llama
    keys = torch.randn(batch, num_kv_heads, kv_len, head_dim, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, num_kv_heads, kv_len, head_dim, generator=gen, dtype=torch.float64)
    lens = torch.tensor([kv_len, kv_len - 3, q_len])     # ragged rows: each row's own prefix
    positions = lens[:, None] - q_len + torch.arange(q_len)[None, :]
    mask = (torch.arange(kv_len)[None, None, :] <= positions[:, :, None])[:, None]  # [b, 1, q, kv]
    groups = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(query, repeat_kv(keys, groups), repeat_kv(values, groups),
                                              attn_mask=mask).transpose(1, 2)
    got = _grouped_attention(query, keys, values, mask.repeat(1, 1, groups, 1), scaling=None)  # folded mask
    assert got.shape == (batch, q_len, num_heads, head_dim)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_bfloat16_runner_close_to_float32_and_verify_matches_decode(tiny_llama):
    torch.manual_seed(0)
    runners = {dt: ModelRunner(ModelConfig(model="tiny", dtype=dt), CacheConfig(max_num_seqs=2, max_model_len=32),
                               model=tiny_llama(dtype=torch.float32)) for dt in ("float32", "bfloat16")}
    prompt, more = [5, 9, 17, 3, 40, 41], [7, 8, 9]
    logits = {}
    for dt, runner in runners.items():
        assert runner.cache.k[0].dtype == getattr(torch, dt)
        slot = runner.allocate_slot()
        runner.prefill([slot], [prompt])
        verify = runner.forward([slot], [more])[0]                     # [3, V] one verify step
        runner.truncate(slot, len(prompt))
        decode = torch.cat([runner.forward([slot], [[t]])[0] for t in more])   # three decode steps
        assert verify.dtype == torch.float32
        torch.testing.assert_close(verify, decode, atol=0.05, rtol=0.05)
        logits[dt] = verify
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.1, rtol=0.05)


def test_resolve_bench_dtype():
    assert resolve_bench_dtype("float32") == "float32"
    assert resolve_bench_dtype("bfloat16") == "bfloat16"
    has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_bench_dtype(AUTO_DTYPE) == ("bfloat16" if has_bf16 else "float32")
    with pytest.raises(ValueError, match="dtype"):
        resolve_bench_dtype("float16")


def test_suite_uses_one_dtype_for_ours_and_vllm(tmp_path):
    DATA = str(tmp_path / "question.jsonl")
    open(DATA, "w").write('{"question_id": 1, "category": "writing", "turns": ["Hi"]}\n')
    cfg = parse_args(["--data", DATA, "--dtype", "bfloat16"])
    assert cfg.dtype == "bfloat16"
    assert parse_args(["--data", DATA]).dtype == resolve_bench_dtype(AUTO_DTYPE)
    assert SuiteConfig(data=DATA).dtype == "float32"                  # programmatic default
    with pytest.raises(ValueError, match="dtype"):
        SuiteConfig(data=DATA, dtype="auto")
    vllm = VllmSystem(SYSTEMS["vllm-ar"], "python", "t", "d", 2, 4, 256, str(tmp_path), dtype=cfg.dtype)
    assert vllm.argv[vllm.argv.index("--dtype") + 1] == "bfloat16"


def test_identity_compare_counts_tokens_after_first_divergence():
    reference = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8, 9]}
    other = {"a": [1, 2, 3, 4], "b": [5, 0], "c": [7, 8]}
    result = compare(reference, other)
    assert result["num_mismatched_requests"] == 2 and result["mismatched_request_ids"] == ["b", "c"]
    assert result["num_reference_tokens"] == 9 and result["num_tokens_after_first_divergence"] == 1 + 1
