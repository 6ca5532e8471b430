"""Static-shape step path (specdec.engine.cuda_graphs): the CPU twin of the CUDA-graph path.

The same static function that is captured in CUDA graphs on a GPU runs eagerly here and is
checked against the dynamic path in float64: ragged rows, batch-padding rows, non-consecutive
slots, KV rollback, and the written KV cache itself.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.engine.cuda_graphs import MIN_KV_BUCKET, StaticStepper, batch_buckets, kv_buckets
from specdec.models.random_models import build_random_model
from specdec.engine.runner import ModelRunner

CACHE = CacheConfig(max_num_seqs=6, max_model_len=160)
STATIC = ModelConfig(dtype="float64", static_shapes=True)
DYNAMIC = ModelConfig(dtype="float64")
TOL = 1e-10


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert kv_buckets(MIN_KV_BUCKET) == (MIN_KV_BUCKET,)
    assert kv_buckets(300) == (64, 128, 256, 300)


def test_config_flags():
    assert not DYNAMIC.use_cuda_graphs and not DYNAMIC.use_static_shapes
    assert STATIC.use_static_shapes and not STATIC.use_cuda_graphs
    assert ModelConfig(device="cuda:0").use_cuda_graphs                     # default on for CUDA
    assert not ModelConfig(device="cuda:0", cuda_graphs=False).use_static_shapes
    with pytest.raises(ValueError, match="cuda_graphs"):
        ModelConfig(cuda_graphs=True)
    with pytest.raises(ValueError, match="static_shapes"):
        ModelConfig(device="cuda:0", cuda_graphs=True, static_shapes=False)
    with pytest.raises(ValueError, match="max_static_tokens"):
        ModelConfig(max_static_tokens=0)


def _runner_pair(make_model):
    static = ModelRunner(STATIC, CACHE, model=make_model())
    dynamic = ModelRunner(DYNAMIC, CACHE, model=make_model())
    assert static.static_stepper is not None and dynamic.static_stepper is None
    assert static.cache.k[0].shape[0] == CACHE.max_num_seqs + 1               # scratch slot
    assert dynamic.cache.k[0].shape[0] == CACHE.max_num_seqs
    return static, dynamic


def _same_step(static, dynamic, slots, rows):
    out_s = static.forward(slots, rows, logits_dtype=torch.float64)
    out_d = dynamic.forward(slots, rows, logits_dtype=torch.float64)
    assert out_s.shape == out_d.shape
    for i, row in enumerate(rows):                       # tokens past a row's end are junk
        torch.testing.assert_close(out_s[i, : len(row)], out_d[i, : len(row)], atol=TOL, rtol=0)


def _same_cache(static, dynamic, slots):
    for slot in slots:
        length = static.seq_len(slot)
        assert length == dynamic.seq_len(slot)
        for layer in range(static.cache.num_layers):
            for a, b in ((static.cache.k, dynamic.cache.k), (static.cache.v, dynamic.cache.v)):
                torch.testing.assert_close(a[layer][slot, :, :length], b[layer][slot, :, :length],
                                           atol=TOL, rtol=0)


def _drive(static, dynamic, vocab_size, seed=0):
    """Prefill, verify (k+1 = 5), decode, ragged catch-up steps, rollback: both paths agree."""
    rng = random.Random(seed)
    slots = [static.allocate_slot() for _ in range(CACHE.max_num_seqs)]
    assert slots == [dynamic.allocate_slot() for _ in range(CACHE.max_num_seqs)]
    for runner in (static, dynamic):
        runner.free_slot(2)                             # non-consecutive slot ids below
    live = [0, 5, 1, 3, 4]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 40))] for _ in live]
    _same_step(static, dynamic, live, prompts)          # prefill: q_max > 8 -> dynamic in both
    toks = lambda n: [rng.randrange(3, vocab_size) for _ in range(n)]  # noqa: E731
    for step in range(6):
        _same_step(static, dynamic, live[:3], [toks(5) for _ in range(3)])       # B=4: 1 pad row
        _same_step(static, dynamic, live, [toks(1) for _ in live])               # B=8: 3 pad rows
        _same_step(static, dynamic, live[1:], [toks(rng.randint(1, 4)) for _ in live[1:]])
        for runner in (static, dynamic):                 # rollback of rejected draft tokens
            runner.truncate(live[step % len(live)], runner.seq_len(live[step % len(live)]) - 2)
    assert max(static.seq_len(s) for s in live) > MIN_KV_BUCKET                # 2 KV buckets
    _same_cache(static, dynamic, live)


def test_static_path_matches_dynamic_llama(tiny_llama):
    static, dynamic = _runner_pair(lambda: tiny_llama(num_layers=2, dtype=torch.float64))
    _drive(static, dynamic, static.vocab_size)


def test_static_path_matches_dynamic_qwen3_random():
    make = lambda: build_random_model("random:tiny-qwen3:1", torch.float64, "cpu")  # noqa: E731
    static, dynamic = _runner_pair(make)
    _drive(static, dynamic, 2000, seed=1)


def test_padding_rows_and_scratch_do_not_change_real_rows(tiny_llama):
    runner = ModelRunner(STATIC, CACHE, model=tiny_llama(dtype=torch.float64))
    slots = [runner.allocate_slot() for _ in range(3)]
    runner.prefill(slots, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    stepper: StaticStepper = runner.static_stepper
    starts = [runner.seq_len(s) for s in slots]
    rows = [[20, 21], [22], [23, 24]]
    scratch = runner.cache.scratch_slot
    outs = []
    for fill in (0.0, 1e3):                               # junk in the scratch slot
        for layer in range(runner.cache.num_layers):
            runner.cache.k[layer][scratch].fill_(fill)
            runner.cache.v[layer][scratch].normal_()
        three = stepper.forward(slots, rows, starts, pad_token_id=0)              # B=4
        two = stepper.forward(slots[:2], rows[:2], starts[:2], pad_token_id=0)    # B=2
        outs.append(three)
        torch.testing.assert_close(three[:2], two, atol=TOL, rtol=0)
    assert torch.equal(outs[0][0, :2], outs[1][0, :2]) and torch.equal(outs[0][1, :1], outs[1][1, :1])
    for layer in range(runner.cache.num_layers):         # no write past a slot's real tokens
        assert runner.cache.k[layer][slots[1], :, starts[1] + 1:].abs().max() == 0


def test_long_rows_take_the_dynamic_path(tiny_llama):
    cfg = ModelConfig(dtype="float64", static_shapes=True, max_static_tokens=2)
    static = ModelRunner(cfg, CACHE, model=tiny_llama(dtype=torch.float64))
    dynamic = ModelRunner(DYNAMIC, CACHE, model=tiny_llama(dtype=torch.float64))
    assert static.static_stepper.accepts(6, 2) and not static.static_stepper.accepts(6, 3)
    assert not static.static_stepper.accepts(7, 1)
    slots = [r.allocate_slot() for r in (static, dynamic)][:1]
    _same_step(static, dynamic, slots, [[4, 5, 6]])     # dynamic in both
    _same_step(static, dynamic, slots, [[7, 8]])        # static vs dynamic
    _same_cache(static, dynamic, slots)


def test_compiled_modules_match(tiny_llama):
    """compile_modules wraps norms and MLPs in torch.compile (dynamo's eager backend on CPU)."""
    cfg = ModelConfig(dtype="float64", static_shapes=True, compile_modules=True)
    static = ModelRunner(cfg, CACHE, model=tiny_llama(dtype=torch.float64))
    dynamic = ModelRunner(DYNAMIC, CACHE, model=tiny_llama(dtype=torch.float64))
    layer = static.model.model.layers[0]
    assert type(layer.mlp).__name__ == "OptimizedModule"
    assert type(layer.input_layernorm).__name__ == "OptimizedModule"
    assert static.weight_bytes == dynamic.weight_bytes
    slots = [r.allocate_slot() for r in (static, dynamic)][:1] * 1
    _same_step(static, dynamic, slots, [[4, 5, 6, 7, 8, 9, 10, 11, 12]])
    _same_step(static, dynamic, slots, [[7, 8, 9]])
    _same_step(static, dynamic, slots, [[3]])
    _same_cache(static, dynamic, slots)


def test_compiled_layers_match():
    """compile_layers: static steps through torch.compile'd decoder layers (dynamo's eager
    backend on CPU) that read their cache through buffers, one graph for all layers."""
    cfg = ModelConfig(dtype="float64", static_shapes=True, compile_layers=True)
    make = lambda: build_random_model("random:tiny-qwen3:4", torch.float64, "cpu")  # noqa: E731
    static = ModelRunner(cfg, CACHE, model=make())
    dynamic = ModelRunner(DYNAMIC, CACHE, model=make())
    attn = static.model.model.layers[1].self_attn
    assert attn.minedraft_k_cache.data_ptr() == static.cache.k[1].data_ptr()
    assert type(static.model.model.layers[0]).__name__ != "OptimizedModule"   # swapped per step
    slots = [static.allocate_slot(), static.allocate_slot()]
    assert slots == [dynamic.allocate_slot(), dynamic.allocate_slot()]
    _same_step(static, dynamic, slots, [list(range(3, 20)), list(range(9, 30))])
    _same_step(static, dynamic, slots, [[7, 8, 9, 10, 11], [5, 6]])
    _same_step(static, dynamic, slots[:1], [[3]])
    _same_cache(static, dynamic, slots)
    with pytest.raises(ValueError, match="compile_layers"):
        ModelConfig(compile_layers=True)
