"""Slot KV cache + ModelRunner: cached decoding must reproduce a cache-free full forward."""

from __future__ import annotations

import pytest
import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.errors import CapacityError
from specdec.kv.kv_cache import SLOT_ATTENTION_NAME
from specdec.engine.runner import ModelRunner

TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4


def make_runner(tiny_llama, dtype="float32", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN):
    model = tiny_llama(dtype=DTYPES[dtype])
    return ModelRunner(
        ModelConfig(model="tiny", dtype=dtype),
        CacheConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
        model=model,
    )


def random_tokens(num_tokens: int, seed: int, vocab_size: int = 128) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num_tokens,), generator=gen).tolist()


def full_logits(reference, token_ids: list[int]) -> torch.Tensor:
    """Cache-free logits [len, V] of the whole sequence."""
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_prefill_then_single_token_decode_matches_full_forward(tiny_llama, dtype):
    runner = make_runner(tiny_llama, dtype)
    reference = tiny_llama(dtype=DTYPES[dtype])
    seqs = [random_tokens(20, seed=1), random_tokens(20, seed=2)]
    prompt_lens = [7, 3]
    slots = [runner.allocate_slot(), runner.allocate_slot()]
    last = runner.prefill(slots, [s[:n] for s, n in zip(seqs, prompt_lens)], DTYPES[dtype])
    refs = [full_logits(reference, s) for s in seqs]
    for i, n in enumerate(prompt_lens):
        assert (last[i] - refs[i][n - 1]).abs().max() < TOLERANCE[dtype]
    for step in range(10):
        positions = [n + step for n in prompt_lens]
        logits = runner.forward(slots, [[s[p]] for s, p in zip(seqs, positions)], DTYPES[dtype])
        assert logits.shape == (2, 1, runner.vocab_size) and logits.dtype == DTYPES[dtype]
        for i, p in enumerate(positions):
            assert (logits[i, 0] - refs[i][p]).abs().max() < TOLERANCE[dtype]
    assert [runner.seq_len(s) for s in slots] == [n + 10 for n in prompt_lens]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("is_consecutive", [True, False], ids=["slot-view", "slot-gather"])
def test_ragged_multi_token_steps_match_full_forward(tiny_llama, dtype, is_consecutive):
    runner = make_runner(tiny_llama, dtype, max_num_seqs=3)
    reference = tiny_llama(dtype=DTYPES[dtype])
    seqs = [random_tokens(40, seed=10 + i) for i in range(3)]
    slots = [runner.allocate_slot() for _ in range(3)]
    slots = slots if is_consecutive else [slots[1], slots[2], slots[0]]
    cursor = [9, 2, 5]
    runner.prefill(slots, [s[:c] for s, c in zip(seqs, cursor)])
    refs = [full_logits(reference, s) for s in seqs]
    for q_lens in ([4, 4, 4], [1, 4, 3], [4, 2, 1]):  # k + 1 = 4 with ragged rows
        rows = [s[c : c + q] for s, c, q in zip(seqs, cursor, q_lens)]
        logits = runner.forward(slots, rows, DTYPES[dtype])
        assert logits.shape == (3, max(q_lens), runner.vocab_size)
        for i, (c, q) in enumerate(zip(cursor, q_lens)):
            assert (logits[i, :q] - refs[i][c : c + q]).abs().max() < TOLERANCE[dtype]
        cursor = [c + q for c, q in zip(cursor, q_lens)]
    assert [runner.seq_len(s) for s in slots] == cursor


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rollback_then_reforward_equals_never_drafted(tiny_llama, dtype):
    runner = make_runner(tiny_llama, dtype)
    reference = tiny_llama(dtype=DTYPES[dtype])
    prompt, drafts, fixes = random_tokens(6, seed=3), random_tokens(4, seed=4), random_tokens(3, seed=5)
    slot = runner.allocate_slot()
    runner.prefill([slot], [prompt])
    runner.forward([slot], [drafts])  # verify step: keep only drafts[0], reject the rest
    runner.truncate(slot, len(prompt) + 1)
    assert runner.seq_len(slot) == len(prompt) + 1
    logits = runner.forward([slot], [fixes], DTYPES[dtype])
    expected = full_logits(reference, prompt + drafts[:1] + fixes)[-len(fixes) :]
    assert (logits[0] - expected).abs().max() < TOLERANCE[dtype]


def test_free_and_reallocate_gives_clean_slot(tiny_llama):
    runner = make_runner(tiny_llama, max_num_seqs=1)
    reference = tiny_llama()
    slot = runner.allocate_slot()
    runner.prefill([slot], [random_tokens(30, seed=6)])
    runner.free_slot(slot)
    assert runner.num_free_slots == 1
    again = runner.allocate_slot()
    assert again == slot and runner.seq_len(again) == 0
    prompt = random_tokens(5, seed=7)
    logits = runner.forward([again], [prompt])
    assert (logits[0] - full_logits(reference, prompt)).abs().max() < TOLERANCE["float32"]


def test_padding_is_never_written_to_the_cache(tiny_llama):
    runner = make_runner(tiny_llama)
    short, long = runner.allocate_slot(), runner.allocate_slot()
    runner.forward([short, long], [random_tokens(2, seed=8), random_tokens(9, seed=9)])
    assert (runner.seq_len(short), runner.seq_len(long)) == (2, 9)
    for layer in range(len(runner.cache.k)):
        assert runner.cache.k[layer][short, :, 2:].abs().max() == 0
        assert runner.cache.v[layer][short, :, 2:].abs().max() == 0
        assert runner.cache.k[layer][long, :, :9].abs().max() > 0


def test_batch_neighbours_do_not_change_a_rows_logits(tiny_llama):
    runner = make_runner(tiny_llama)
    tokens = random_tokens(8, seed=11)
    alone = runner.allocate_slot()
    expected = runner.forward([alone], [tokens])
    row, other = runner.allocate_slot(), runner.allocate_slot()
    runner.prefill([other], [random_tokens(20, seed=12)])
    got = runner.forward([other, row], [random_tokens(3, seed=13), tokens])
    assert (got[1, : len(tokens)] - expected[0]).abs().max() < TOLERANCE["float32"]


def test_capacity_and_argument_errors(tiny_llama):
    runner = make_runner(tiny_llama, max_num_seqs=2, max_model_len=8)
    a, b = runner.allocate_slot(), runner.allocate_slot()
    assert runner.num_free_slots == 0
    with pytest.raises(CapacityError, match="max_num_seqs=2"):
        runner.allocate_slot()
    runner.forward([a], [[5] * 6])
    with pytest.raises(CapacityError, match="max_model_len=8"):
        runner.forward([a], [[5] * 3])
    assert runner.seq_len(a) == 6  # a refused forward changes nothing
    runner.forward([a], [[5] * 2])  # exactly full is fine
    runner.free_slot(b)
    bad_calls = [
        (runner.forward, ([b], [[5]]), "not allocated"),
        (runner.forward, ([7], [[5]]), "slot must be"),
        (runner.forward, ([a, a], [[5], [5]]), "distinct"),
        (runner.forward, ([a], [[]]), "empty"),
        (runner.forward, ([a], [[runner.vocab_size]]), "token ids"),
        (runner.forward, ([], []), "non-empty"),
        (runner.truncate, (a, 9), "length must be"),
        (runner.free_slot, (b,), "not allocated"),
    ]
    for call, args, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            call(*args)


def test_runner_attributes(tiny_llama):
    runner = make_runner(tiny_llama)
    assert runner.vocab_size == 128 and runner.eos_token_ids == (2,)
    assert runner.num_free_slots == MAX_NUM_SEQS
    assert runner.weight_bytes == sum(p.numel() * 4 for p in runner.model.parameters())
    # 2 (k, v) * layers * slots * kv heads * positions * head_dim * 4 bytes
    assert runner.kv_cache_bytes == 2 * 2 * MAX_NUM_SEQS * 2 * MAX_MODEL_LEN * 16 * 4
    runner64 = make_runner(tiny_llama, "float64")
    slot = runner64.allocate_slot()
    assert runner64.forward([slot], [[5, 6]]).dtype == torch.float32  # the contract's default
    assert runner64.prefill([runner64.allocate_slot()], [[5]]).shape == (1, 128)


def test_slot_attention_uses_a_config_copy_and_falls_back_without_cache(tiny_llama):
    from transformers import LlamaForCausalLM

    shared = tiny_llama()
    sibling = LlamaForCausalLM(shared.config).eval()  # a second model on the same config object
    runner = ModelRunner(ModelConfig(model="tiny"), CacheConfig(), model=shared)
    assert runner.model.config._attn_implementation == SLOT_ATTENTION_NAME
    assert sibling.config._attn_implementation == "sdpa"
    tokens = torch.tensor([random_tokens(6, seed=14)])
    with torch.no_grad():  # no slot metadata: plain causal attention, same as the reference
        got = runner.model(tokens).logits
    assert (got - tiny_llama()(tokens).logits).abs().max() < TOLERANCE["float32"]


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ModelConfig(model=""), "model"),
        (lambda: ModelConfig(gguf_file="weights.bin"), "gguf_file"),
        (lambda: ModelConfig(dtype="int8"), "dtype"),
        (lambda: ModelConfig(device="gpu7"), "device"),
        (lambda: ModelConfig(num_threads=0), "num_threads"),
        (lambda: CacheConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: CacheConfig(max_model_len=1), "max_model_len"),
    ],
)
def test_config_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_configs_are_frozen():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().dtype = "float64"
    assert ModelConfig(dtype="float64").torch_dtype == torch.float64


def test_random_forward_and_rollback_sequences_match_full_forward(tiny_llama):
    """Property: any mix of ragged forwards and rollbacks equals a cache-free forward (float64)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    runner = make_runner(tiny_llama, "float64", max_num_seqs=3, max_model_len=48)
    reference = tiny_llama(dtype=torch.float64)
    slots = [runner.allocate_slot() for _ in range(3)]
    step = st.tuples(
        st.lists(st.lists(st.integers(3, 127), min_size=1, max_size=5), min_size=3, max_size=3),
        st.lists(st.integers(0, 4), min_size=3, max_size=3),  # tokens to roll back afterwards
    )

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(step, min_size=1, max_size=5))
    def check(steps):
        for slot in slots:
            runner.truncate(slot, 0)
        committed = [[] for _ in slots]
        for rows, rollbacks in steps:
            logits = runner.forward(slots, rows, torch.float64)
            for i, row in enumerate(rows):
                committed[i] += row
                expected = full_logits(reference, committed[i])[-len(row) :]
                assert (logits[i, : len(row)] - expected).abs().max() < TOLERANCE["float64"]
                keep = max(1, len(committed[i]) - rollbacks[i])
                runner.truncate(slots[i], keep)
                committed[i] = committed[i][:keep]

    check()


def test_dynamic_attention_on_cuda_leaves_out_cudnn_sdpa():
    """cuDNN's SDPA plans every new (batch, length) shape (60-140 ms of host time per call on an
    H200), so the dynamic-shape path on CUDA must not allow it; CPU calls are left alone."""
    from types import SimpleNamespace

    from specdec.kv.slot_attention import _dynamic_backends

    assert torch.backends.cuda.cudnn_sdp_enabled()
    with _dynamic_backends(SimpleNamespace(is_cuda=True)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with _dynamic_backends(torch.zeros(1)):
        assert torch.backends.cuda.cudnn_sdp_enabled()
