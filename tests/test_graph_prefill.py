"""One-prompt static prefill (``StaticStepper.prefill``, ``ModelConfig.max_graph_prefill_tokens``).

On a GPU an admission of one prompt replays a CUDA graph captured per length bucket; here the
same static function runs eagerly (the CPU twin) and is checked in float64 against the dynamic
path: last-token logits, the KV written, later steps, a slot that already holds tokens, the
padding's keys and values going only to the scratch slot, and the shapes that are precaptured.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_cuda_graphs import CACHE, DYNAMIC, TOL, _same_cache, _same_step

from specdec.engine import static_forward as static_forward_module
from specdec.config import CUDA_GRAPH_PREFILL_TOKENS, CacheConfig, ModelConfig
from specdec.engine.runner import ModelRunner, _graph_prefill_tokens
from specdec.engine.shape_buckets import prefill_buckets

PREFILL = ModelConfig(dtype="float64", static_shapes=True, max_graph_prefill_tokens=64)


def _pair(tiny_llama, cfg=PREFILL):
    static = ModelRunner(cfg, CACHE, model=tiny_llama(num_layers=2, dtype=torch.float64))
    dynamic = ModelRunner(DYNAMIC, CACHE, model=tiny_llama(num_layers=2, dtype=torch.float64))
    return static, dynamic


def _same_prefill(static, dynamic, slots, prompts):
    out_s = static.prefill(slots, prompts, logits_dtype=torch.float64)
    out_d = dynamic.prefill(slots, prompts, logits_dtype=torch.float64)
    assert out_s.shape == out_d.shape == (len(prompts), static.vocab_size)
    torch.testing.assert_close(out_s, out_d, atol=TOL, rtol=0)


def test_prefill_buckets():
    assert prefill_buckets(1024, 8) == (16, 32, 64, 128, 256, 512, 1024)
    assert prefill_buckets(100, 8) == (16, 32, 64, 100)
    assert prefill_buckets(20, 16) == (20,)          # 16 is a step's width: steps take it
    assert prefill_buckets(8, 8) == () and prefill_buckets(0, 8) == ()


def test_config_and_resolution():
    with pytest.raises(ValueError, match="max_graph_prefill_tokens"):
        ModelConfig(max_graph_prefill_tokens=-1)
    with pytest.raises(ValueError, match="static_shapes"):
        ModelConfig(max_graph_prefill_tokens=64)                  # CPU default: no static path
    assert _graph_prefill_tokens(ModelConfig(), use_graphs=True) == CUDA_GRAPH_PREFILL_TOKENS
    assert _graph_prefill_tokens(ModelConfig(), use_graphs=False) == 0
    assert _graph_prefill_tokens(PREFILL, use_graphs=False) == 64


def test_default_static_cpu_runner_has_no_prefill_buckets(tiny_llama):
    cfg = ModelConfig(dtype="float64", static_shapes=True)
    assert ModelRunner(cfg, CACHE, model=tiny_llama()).static_stepper.prefill_buckets == ()


def test_bucket_capped_at_max_model_len(tiny_llama):
    cfg = ModelConfig(dtype="float64", static_shapes=True, max_graph_prefill_tokens=4096)
    stepper = ModelRunner(cfg, CACHE, model=tiny_llama()).static_stepper
    assert stepper.prefill_buckets[-1] == CACHE.max_model_len == 160
    assert stepper.accepts_prefill(1, 160) and not stepper.accepts_prefill(2, 20)


@pytest.mark.parametrize("length", [9, 16, 17, 33, 64])
def test_one_prompt_matches_dynamic_then_steps_agree(tiny_llama, length):
    static, dynamic = _pair(tiny_llama)
    rng = random.Random(length)
    slots = [static.allocate_slot() for _ in range(3)]
    assert slots == [dynamic.allocate_slot() for _ in range(3)]
    _same_prefill(static, dynamic, [slots[0]], [[rng.randrange(3, 128) for _ in range(12)]])
    _same_prefill(static, dynamic, [slots[2]], [[rng.randrange(3, 128) for _ in range(length)]])
    bucket = next(b for b in static.static_stepper.prefill_buckets if b >= length)
    assert static.static_stepper.used_prefill_shapes == {(16, 64), (bucket, 64)}
    for _ in range(3):                                             # decode/verify on top
        _same_step(static, dynamic, slots[::2], [[rng.randrange(3, 128) for _ in range(5)]] * 2)
    _same_cache(static, dynamic, slots)
    for layer in range(static.cache.num_layers):                  # the empty slot stays empty
        assert static.cache.k[layer][slots[1]].abs().max() == 0


def test_prefill_into_a_slot_that_holds_tokens(tiny_llama):
    static, dynamic = _pair(tiny_llama)
    slot = static.allocate_slot()
    dynamic.allocate_slot()
    _same_prefill(static, dynamic, [slot], [list(range(3, 63))])
    _same_prefill(static, dynamic, [slot], [list(range(70, 82))])   # a drafter's catch-up
    assert static.seq_len(slot) == 72                               # reads past the 64 bucket
    assert static.static_stepper.used_prefill_shapes == {(64, 64), (16, 128)}
    _same_cache(static, dynamic, [slot])


def test_longer_prompts_and_batches_take_the_dynamic_path(tiny_llama):
    static, dynamic = _pair(tiny_llama)
    slots = [static.allocate_slot() for _ in range(2)]
    [dynamic.allocate_slot() for _ in range(2)]
    _same_prefill(static, dynamic, slots[:1], [[3 + i % 120 for i in range(100)]])         # 100 > 64
    _same_prefill(static, dynamic, slots[1:], [list(range(3, 8))])           # 5 <= 8: step path
    assert not static.static_stepper.used_prefill_shapes
    more = [static.allocate_slot() for _ in range(2)]
    assert more == [dynamic.allocate_slot() for _ in range(2)]
    _same_prefill(static, dynamic, more, [list(range(3, 23)), list(range(3, 30))])   # 2 prompts
    assert not static.static_stepper.used_prefill_shapes


def test_junk_in_scratch_slot_does_not_change_the_prefill(tiny_llama):
    static, dynamic = _pair(tiny_llama)
    scratch = static.cache.scratch_slot
    for layer in range(static.cache.num_layers):
        static.cache.k[layer][scratch].fill_(1e3)
        static.cache.v[layer][scratch].normal_()
    slot = static.allocate_slot()
    dynamic.allocate_slot()
    _same_prefill(static, dynamic, [slot], [list(range(3, 23))])
    _same_cache(static, dynamic, [slot])


def test_model_without_logits_to_keep_gathers_the_last_token(tiny_llama, monkeypatch):
    monkeypatch.setattr(static_forward_module, "has_logits_to_keep", lambda model: False)
    static, dynamic = _pair(tiny_llama)
    slot = static.allocate_slot()
    dynamic.allocate_slot()
    _same_prefill(static, dynamic, [slot], [list(range(3, 30))])


def test_precapture_covers_prefill_buckets_and_changes_nothing(tiny_llama):
    static, dynamic = _pair(tiny_llama)
    stepper = static.static_stepper
    count, _ = stepper.precapture(run_eager=True)
    assert stepper.precaptured_prefill_shapes == {(16, 64), (32, 64), (64, 64)}
    assert count == len(stepper.all_shapes()) + 3
    slot = static.allocate_slot()
    dynamic.allocate_slot()
    _same_prefill(static, dynamic, [slot], [list(range(3, 50))])
    assert stepper.used_prefill_shapes <= stepper.precaptured_prefill_shapes


def _cuda_budget(monkeypatch):
    """The CUDA default budget (8192) for ModelConfig on this CPU."""
    monkeypatch.setattr(ModelConfig, "prefill_token_budget", property(lambda self: 8192))


def test_graph_prefill_resolves_the_default_budget_to_one_prompt_per_forward(tiny_llama, monkeypatch):
    _cuda_budget(monkeypatch)
    model = tiny_llama()
    assert ModelRunner(PREFILL, CACHE, model=model).prefill_token_budget == 0
    with pytest.raises(ValueError, match="exclude each other"):
        ModelConfig(dtype="float64", static_shapes=True, max_graph_prefill_tokens=64, max_prefill_tokens=512)
    batched = ModelConfig(dtype="float64", static_shapes=True, max_prefill_tokens=512)
    assert _graph_prefill_tokens(batched, use_graphs=True) == 0     # grouped prefills asked for
    assert ModelRunner(batched, CACHE, model=tiny_llama()).prefill_token_budget == 512
    off = ModelConfig(dtype="float64", static_shapes=True, max_graph_prefill_tokens=0,
                      max_prefill_tokens=None)
    assert ModelRunner(off, CACHE, model=tiny_llama()).prefill_token_budget == 8192


def test_a_burst_gets_the_same_kv_as_prompts_admitted_alone(tiny_llama, monkeypatch):
    """Every prompt takes its own graph forward, so a prompt's KV (and first token) is the same
    whether it was admitted with others or alone."""
    _cuda_budget(monkeypatch)
    from specdec.sample.sampling import SamplingParams
    from specdec.engine.worker import TargetWorker

    prompts = [[3 + (7 * i + j) % 120 for j in range(n)] for i, n in enumerate((20, 45, 12, 33))]
    greedy = SamplingParams(temperature=0.0)
    burst = TargetWorker(ModelRunner(PREFILL, CACHE, model=tiny_llama(dtype=torch.float64)), seed=0)
    alone = TargetWorker(ModelRunner(PREFILL, CACHE, model=tiny_llama(dtype=torch.float64)), seed=0)
    burst.add_requests([(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        alone.add_requests([(f"r{i}", prompt, greedy)])
    assert burst.runner.static_stepper.used_prefill_shapes == {(16, 64), (32, 64), (64, 64)}
    for layer in range(burst.runner.cache.num_layers):
        for cache_b, cache_a in ((burst.runner.cache.k, alone.runner.cache.k),
                                 (burst.runner.cache.v, alone.runner.cache.v)):
            assert torch.equal(cache_b[layer][: len(prompts)], cache_a[layer][: len(prompts)])


def test_causal_shortcut_only_when_every_prompt_is_prefilled_alone(tiny_llama):
    for budget, is_shortcut in ((0, True), (256, False), (None, True)):   # None: 0 on this CPU
        cfg = ModelConfig(dtype="float64", max_prefill_tokens=budget)
        runner = ModelRunner(cfg, CACHE, model=tiny_llama())
        assert runner.cache.is_causal_shortcut is is_shortcut


def test_padding_positions_do_not_change_a_dynamic_rope(tiny_llama):
    """transformers' "dynamic" RoPE picks its frequencies from the largest position seen, so the
    bucket's padding tokens must not carry positions past the prompt (found by a break-it pass)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def model():
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=80,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).double().eval()

    cache = CacheConfig(max_num_seqs=1, max_model_len=160)
    static = ModelRunner(ModelConfig(dtype="float64", static_shapes=True, max_graph_prefill_tokens=128),
                         cache, model=model())
    dynamic = ModelRunner(DYNAMIC, cache, model=model())
    static.allocate_slot()
    dynamic.allocate_slot()
    _same_prefill(static, dynamic, [0], [[3 + 7 * i % 120 for i in range(70)]])   # 70 <= 80, bucket 128
    assert static.static_stepper.used_prefill_shapes == {(128, 128)}
    _same_cache(static, dynamic, [0])
