"""Random-weight presets (specdec.models.random_models) and the loader's ``random:`` hook."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.models.loader import load_model
from specdec.models.resolve import resolve_model_dir
from specdec.models.random_models import (
    PRESETS, RANDOM_MARKER, RANDOM_VOCAB_SIZE, TOKENIZER_ENV, build_random_model, make_config,
    parse_spec,
)
from specdec.engine.runner import ModelRunner


@pytest.fixture
def random_cache(tmp_path, monkeypatch, smollm2_dir):
    """A fresh MineDraft cache, with the SmolLM2 tokenizer named explicitly."""
    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(TOKENIZER_ENV, smollm2_dir)
    return tmp_path / "cache"


def test_parse_spec_seed_and_errors():
    assert parse_spec("random:llama-8b") == ("llama-8b", 0)
    assert parse_spec("random:qwen3-0.6b:17") == ("qwen3-0.6b", 17)
    for bad in ("random:gpt-9", "random:llama-8b:x", "random:llama-8b:-1", "llama-8b"):
        with pytest.raises(ValueError):
            parse_spec(bad)


@pytest.mark.parametrize("preset,num_params", [
    ("smollm2-135m", 134_515_008), ("llama-8b", 7_382_241_280), ("qwen3-0.6b", 490_799_104),
])
def test_full_presets_shapes_on_meta(preset, num_params):
    """The real-size presets, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(preset))
    spec = PRESETS[preset]
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (
        spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads,
        spec.intermediate_size, spec.head_dim, RANDOM_VOCAB_SIZE)
    assert sum(p.numel() for p in model.parameters()) == num_params
    assert model.model.layers[0].self_attn.k_proj.out_features == spec.num_kv_heads * spec.head_dim


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_tiny_preset_deterministic_by_seed(preset):
    a = build_random_model(f"random:{preset}:5", torch.float32, "cpu")
    b = build_random_model(f"random:{preset}:5", torch.float32, "cpu")
    c = build_random_model(f"random:{preset}:6", torch.float32, "cpu")
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    embed = a.get_input_embeddings().weight.detach()
    assert a.lm_head.weight.data_ptr() == embed.data_ptr()                 # tied, as preset says
    assert abs(float(embed.std()) - 64 ** -0.5) < 0.002 and abs(float(embed.mean())) < 0.002
    down = a.model.layers[0].mlp.down_proj.weight.detach()                 # fan_in 128
    assert abs(float(down.std()) - 128 ** -0.5) < 0.005
    norm_weights = [p for n, p in a.named_parameters() if "norm" in n]
    assert norm_weights and all(torch.equal(p, torch.ones_like(p)) for p in norm_weights)
    inv_freq = a.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32 and torch.allclose(
        inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ids = torch.tensor([[1, 400, 30000, 7]])
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_loader_resolves_and_loads_random_spec(random_cache, smollm2_dir):
    cfg = ModelConfig(model="random:tiny-qwen3:2", dtype="float64")
    model_dir = resolve_model_dir(cfg)
    assert model_dir == str(random_cache / "models" / "random-tiny-qwen3-s2")
    with open(os.path.join(model_dir, RANDOM_MARKER)) as fh:
        marker = json.load(fh)
    assert marker["weights"] == "random weights" and marker["seed"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ref = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert tok.encode("random weights, real tokenizer") == ref.encode("random weights, real tokenizer")
    model = load_model(cfg)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config._attn_implementation == "minedraft_slot"
    assert next(model.parameters()).dtype == torch.float64
    runner = ModelRunner(cfg, CacheConfig(max_num_seqs=2, max_model_len=32))
    slot = runner.allocate_slot()
    logits = runner.prefill([slot], [[1, 2, 3, 4]])
    assert logits.shape == (1, RANDOM_VOCAB_SIZE) and torch.isfinite(logits).all()


def test_unknown_preset_is_a_clear_error(random_cache):
    with pytest.raises(ValueError, match="unknown random preset"):
        resolve_model_dir(ModelConfig(model="random:llama-70b"))


def test_a_dir_written_without_a_tokenizer_gets_one_once_one_is_found(random_cache, monkeypatch, smollm2_dir):
    """A random dir cached by a Python that found no tokenizer (e.g. without the GGUF package) is
    completed later, instead of staying tokenizer-less and failing the gateway forever."""
    from specdec.models import random_models

    monkeypatch.setattr(random_models, "find_tokenizer_dir", lambda: None)
    bare = random_models.model_dir("random:tiny-llama:5")
    assert not os.path.isfile(os.path.join(bare, "tokenizer.json"))
    monkeypatch.setattr(random_models, "find_tokenizer_dir", lambda: smollm2_dir)
    assert random_models.model_dir("random:tiny-llama:5") == bare
    assert os.path.isfile(os.path.join(bare, "tokenizer.json"))
    assert not [name for name in os.listdir(bare) if name.endswith(".tmp")]
