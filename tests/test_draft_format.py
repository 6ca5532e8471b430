"""Draft directory format: round trip, borrowed embeddings, fingerprint refusal (issue 4)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM

from specdec.models import draft_format as fmt
from specdec.config import ModelConfig
from specdec.errors import IncompatibleDraftError

NUM_TARGET_LAYERS = 4
DRAFT_LAYERS = [0, 3]


@pytest.fixture
def target_dir(tmp_path, tiny_llama_dir):
    return tiny_llama_dir(tmp_path / "target", num_layers=NUM_TARGET_LAYERS, seed=0)


@pytest.fixture
def draft_dir(tmp_path, target_dir):
    out = str(tmp_path / "draft")
    fmt.make_truncated_draft(target_dir, DRAFT_LAYERS, out)
    return out


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 5, 9, 17, 33, 64, 100, 3]])


def test_draft_dir_holds_only_own_weights_and_metadata(draft_dir, target_dir):
    with safe_open(os.path.join(draft_dir, fmt.DRAFT_WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
    assert keys and all(k.startswith(fmt.OWN_WEIGHT_PREFIXES) for k in keys)
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    assert {k.split(".")[2] for k in keys if k.startswith("model.layers.")} == {"0", "1"}
    meta = json.load(open(os.path.join(draft_dir, fmt.DRAFT_META_FILE)))
    assert meta["num_layers"] == 2 and meta["init_layers"] == DRAFT_LAYERS
    assert meta["target"] == os.path.abspath(target_dir)
    assert fmt.is_draft_dir(draft_dir) and not fmt.is_draft_dir(target_dir)


def test_load_draft_round_trip_matches_target_layers(draft_dir, target_dir):
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    draft = fmt.load_draft(draft_dir)
    assert draft.config.num_hidden_layers == 2
    assert draft.model.embed_tokens.weight is draft.lm_head.weight  # tied: one shared tensor
    torch.testing.assert_close(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    for i, src in enumerate(DRAFT_LAYERS):
        for (name, p), (_, q) in zip(draft.model.layers[i].named_parameters(),
                                     target.model.layers[src].named_parameters()):
            torch.testing.assert_close(p, q, msg=name)
    reference = fmt.build_draft_from_target(target, DRAFT_LAYERS).eval()
    with torch.no_grad():
        torch.testing.assert_close(draft(_ids()).logits, reference(_ids()).logits)


def test_load_draft_shares_target_model_tensors_by_reference(draft_dir, target_dir):
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    draft = fmt.load_draft(draft_dir, target_model=target, attn_implementation="eager")
    assert draft.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert draft.config._attn_implementation == "eager"


def test_untied_target_lends_its_lm_head(tmp_path, tiny_llama_dir):
    target_dir = tiny_llama_dir(tmp_path / "untied", num_layers=3, tie_word_embeddings=False)
    fmt.make_truncated_draft(target_dir, [1], str(tmp_path / "d"))
    draft = fmt.load_draft(str(tmp_path / "d"))
    target = LlamaForCausalLM.from_pretrained(target_dir)
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight)
    assert not torch.equal(draft.lm_head.weight, draft.model.embed_tokens.weight)


def test_refuses_draft_when_target_does_not_match(tmp_path, draft_dir, tiny_llama_dir):
    other = tiny_llama_dir(tmp_path / "other", num_layers=NUM_TARGET_LAYERS, seed=1)
    with pytest.raises(IncompatibleDraftError):
        fmt.load_draft(draft_dir, target_dir=other)
    wider = tiny_llama_dir(tmp_path / "wide", num_layers=NUM_TARGET_LAYERS, vocab_size=256)
    with pytest.raises(IncompatibleDraftError):
        fmt.load_draft(draft_dir, target_dir=wider)


def test_fingerprint_tolerates_bf16_copy_of_the_same_target(target_dir):
    embed = LlamaForCausalLM.from_pretrained(target_dir).model.embed_tokens.weight
    expected = fmt.embedding_fingerprint(embed)
    fmt.check_fingerprint(expected, embed.to(torch.bfloat16))
    fmt.check_fingerprint(expected, embed.to(torch.float16))
    with pytest.raises(IncompatibleDraftError):
        fmt.check_fingerprint(expected, embed + 0.05 * torch.randn_like(embed))


def test_load_draft_respects_model_config_dtype(draft_dir):
    draft = fmt.load_draft(draft_dir, ModelConfig(model=draft_dir, dtype="bfloat16"))
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.isfinite(draft(_ids()).logits.float()).all()


def test_engine_loader_delegates_to_draft_format(draft_dir):
    from specdec.models.loader import load_model

    model = load_model(ModelConfig(model=draft_dir))
    assert model.config.num_hidden_layers == 2
    assert model.model.embed_tokens.weight is model.lm_head.weight


def test_build_draft_rejects_bad_layers(target_dir):
    target = LlamaForCausalLM.from_pretrained(target_dir)
    for layers in ([], [NUM_TARGET_LAYERS], [-1]):
        with pytest.raises(ValueError):
            fmt.build_draft_from_target(target, layers)


def test_meta_validation_names_the_field():
    with pytest.raises(ValueError, match="init_layers"):
        fmt.DraftMeta(target="t", target_fingerprint={}, num_layers=2, init_layers=(0,))
    with pytest.raises(ValueError, match="num_layers"):
        fmt.DraftMeta(target="t", target_fingerprint={}, num_layers=0, init_layers=())


def test_sharing_a_target_of_another_dtype_is_refused(draft_dir, target_dir):
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    with pytest.raises(ValueError, match="dtype"):
        fmt.load_draft(draft_dir, ModelConfig(model=draft_dir, dtype="bfloat16"), target_model=target)


def test_draft_config_drops_the_targets_quantization_config():
    from transformers import LlamaConfig

    gguf = {"quant_method": "gguf", "gguf_file": "t.gguf", "dequantize": False}
    cfg = fmt.draft_config_from_target(LlamaConfig(num_hidden_layers=4, quantization_config=gguf), 2)
    assert cfg.num_hidden_layers == 2 and getattr(cfg, "quantization_config", None) is None


def test_reduced_draft_vocab_round_trips_and_gathers_the_target_head(tmp_path, target_dir):
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    vocab_ids = torch.tensor([0, 2, 5, 9, 17, 64, 100, 127])
    draft = fmt.build_draft_from_target(target, DRAFT_LAYERS, vocab_ids)
    meta = fmt.DraftMeta(target=os.path.abspath(target_dir), num_layers=2, init_layers=tuple(DRAFT_LAYERS),
                         target_fingerprint=fmt.embedding_fingerprint(target.model.embed_tokens.weight),
                         draft_vocab_size=len(vocab_ids))
    out = str(tmp_path / "reduced")
    fmt.save_draft(draft, out, meta)
    with safe_open(os.path.join(out, fmt.DRAFT_WEIGHTS_FILE), framework="pt") as f:
        assert fmt.DRAFT_VOCAB_KEY in f.keys() and not any("lm_head" in k for k in f.keys())
    loaded = fmt.load_draft(out, target_model=target)
    assert torch.equal(fmt.draft_vocab_ids(loaded), vocab_ids)
    torch.testing.assert_close(loaded.lm_head.weight, target.lm_head.weight[vocab_ids])
    with torch.no_grad():
        logits = loaded(input_ids=_ids()).logits
        full = fmt.build_draft_from_target(target, DRAFT_LAYERS)(input_ids=_ids()).logits
    assert logits.shape == (1, _ids().shape[1], len(vocab_ids))
    torch.testing.assert_close(logits, full[..., vocab_ids])
    assert fmt.read_meta(out).draft_vocab_size == len(vocab_ids)
    assert fmt.draft_vocab_ids(fmt.load_draft(out)) is not None  # target read from its dir


@pytest.mark.parametrize("bad", [[], [3, 3], [0, 128], [-1, 4]])
def test_reduced_draft_vocab_rejects_bad_ids(target_dir, bad):
    target = LlamaForCausalLM.from_pretrained(target_dir)
    with pytest.raises(ValueError, match="vocab_ids"):
        fmt.build_draft_from_target(target, [0], torch.tensor(bad, dtype=torch.int64))


def test_meta_and_weights_must_agree_on_the_draft_vocab(tmp_path, target_dir):
    target = LlamaForCausalLM.from_pretrained(target_dir)
    draft = fmt.build_draft_from_target(target, [0], torch.tensor([1, 2, 3]))
    meta = fmt.DraftMeta(target=target_dir, num_layers=1, init_layers=(0,), target_fingerprint={})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        fmt.save_draft(draft, str(tmp_path / "d"), meta)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        fmt.DraftMeta(target="t", num_layers=1, init_layers=(0,), target_fingerprint={}, draft_vocab_size=0)


def test_weights_over_the_shard_limit_are_written_and_read_as_shards(tmp_path, draft_dir, target_dir):
    weights = fmt.read_draft_weights(draft_dir)
    sizes = [t.numel() * t.element_size() for t in weights.values()]
    limit = max(sizes) * 2
    out = tmp_path / "sharded"
    out.mkdir()
    (out / fmt.DRAFT_WEIGHTS_FILE).write_bytes(b"stale")              # an earlier unsharded save
    paths = fmt.write_draft_weights(weights, str(out), max_shard_bytes=limit)
    assert len(paths) > 2 and not (out / fmt.DRAFT_WEIGHTS_FILE).exists()
    assert paths == fmt.draft_weight_files(str(out)) and all(
        os.path.basename(p) == f"model-{i:05d}-of-{len(paths):05d}.safetensors" for i, p in enumerate(paths, 1))
    for path in paths:
        with safe_open(path, framework="pt") as f:
            shard_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        assert shard_bytes <= limit
    read = fmt.read_draft_weights(str(out))
    assert list(read) == list(weights) and all(torch.equal(read[k], weights[k]) for k in weights)
    for name in ("config.json", fmt.DRAFT_META_FILE):
        (out / name).write_bytes((tmp_path / "draft" / name).read_bytes())
    sharded, whole = fmt.load_draft(str(out), target_dir=target_dir), fmt.load_draft(draft_dir, target_dir=target_dir)
    ids = torch.tensor([[1, 5, 9, 17]])
    torch.testing.assert_close(sharded(ids).logits, whole(ids).logits, atol=0, rtol=0)
    fmt.write_draft_weights(weights, str(out))                          # fits again: one file, shards gone
    assert fmt.draft_weight_files(str(out)) == [str(out / fmt.DRAFT_WEIGHTS_FILE)]


def test_a_draft_dir_without_weights_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="draft_dir"):
        fmt.read_draft_weights(str(tmp_path))


def test_the_default_draft_goes_only_to_a_target_of_its_embedding_shape(tmp_path) -> None:
    """``minedraft up`` without ``--draft``: the distilled SmolLM2 draft for a target of its
    [vocab, hidden]; a ``random:llama-8b``-shaped target gets the truncated fallback instead of a
    drafter that dies on the fingerprint check at start."""
    import json
    import os

    from minedraft.stack import DEFAULT_DRAFT_DIR, StackConfig, draft_fits_target, resolve_draft_dir

    meta = tmp_path / "draft"
    meta.mkdir()
    (meta / "minedraft_draft.json").write_text(json.dumps({"target_fingerprint": {"shape": [49152, 576]}}))
    for name, config, fits in (("smol", {"vocab_size": 49152, "hidden_size": 576}, True),
                               ("llama", {"vocab_size": 128256, "hidden_size": 4096}, False),
                               ("nested", {"text_config": {"vocab_size": 49152, "hidden_size": 4096}}, False),
                               ("gguf-only", None, True)):
        target = tmp_path / name
        target.mkdir()
        if config is not None:
            (target / "config.json").write_text(json.dumps(config))
        assert draft_fits_target(str(meta), str(target)) is fits, name
    if os.path.isdir(DEFAULT_DRAFT_DIR):
        assert resolve_draft_dir(StackConfig(), str(tmp_path / "smol")) == DEFAULT_DRAFT_DIR
    assert resolve_draft_dir(StackConfig(draft="mine"), str(tmp_path / "llama")) == "mine"
