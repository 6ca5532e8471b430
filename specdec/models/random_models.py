"""Randomly initialised models of realistic shape (``random:<preset>[:<seed>]``), for benchmarks.

A model spec ``random:llama-8b`` (or ``random:llama-8b:7`` for seed 7; default seed 0) is
accepted wherever a target or draft model is named (``ModelConfig.model``). Its weights are
**random weights**: every output made with them must say so (their text is meaningless and
acceptance of a draft is near zero unless a benchmark fixes it).

Presets (all with vocab 49152, so they share SmolLM2's tokenizer):

===================  ==========  ======  ======  =====  ========  ============  ========
preset               arch        hidden  layers  heads  kv heads  intermediate  head_dim
===================  ==========  ======  ======  =====  ========  ============  ========
``smollm2-135m``     Llama       576     30      9      3         1536          64
``llama-8b``         Llama       4096    32      32     8         14336         128
``qwen3-0.6b``       Qwen3       1024    28      16     8         3072          128
``tiny-llama``       Llama       64      2       4      2         128           16
``tiny-qwen3``       Qwen3       64      2       4      2         128           16
``tiny-llama-hd64``  Llama       128     2       2      1         256           64
===================  ==========  ======  ======  =====  ========  ============  ========

``llama-8b`` is the Llama-3-8B shape with SmolLM2's vocab (7.38e9 parameters, 14.8 GB in bf16);
``qwen3-0.6b`` is Qwen3-0.6B's shape with SmolLM2's vocab (0.49e9 parameters: a realistic
draft size).

Resolution (``model_dir``): the spec becomes a small dir under
``$MINEDRAFT_CACHE/models/random-<preset>-s<seed>`` holding ``config.json``, a generation config,
the marker ``minedraft_random.json`` (preset, seed, init std) and, when one is found, a
tokenizer, so that the torch-free gateway can resolve and tokenize as for a real model. The
tokenizer comes from ``$MINEDRAFT_RANDOM_TOKENIZER`` (a dir with a tokenizer), else the
SmolLM2-135M-Instruct conversion (``specdec.models.gguf``, if its package is installed); without
either the dir has no tokenizer and only token ids can be served.

Init (``build_random_model``): modules are built on the ``meta`` device, materialised with
``to_empty`` directly on the target device, then filled in place: every matrix and embedding
``W`` of shape ``[..., n]`` gets ``normal_(0, 1 / sqrt(n))`` (variance preserving: each layer's
output is of the same scale as its input, so the logits depend on the whole network; with a
flat ``std = 0.02`` a small tied-embedding model only repeats its last input token) from a
``torch.Generator`` seeded with the spec's seed on that device, norm weights 1, biases 0,
rotary buffers recomputed. An 8B bf16 model so inits in about 0.1 s on an H200 (measured by
``bench/gpu/gpu_step.py``; no host copy). Same seed, device and dtype -> identical weights.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from specdec.config import ModelConfig
from specdec.models.cache import build_cached_dir, cache_root
from specdec.models.gguf import hf_model_dir

RANDOM_PREFIX = "random:"
RANDOM_MARKER = "minedraft_random.json"
TOKENIZER_ENV = "MINEDRAFT_RANDOM_TOKENIZER"
RANDOM_VOCAB_SIZE = 49152          # SmolLM2's vocab
DEFAULT_SEED = 0
FAN_IN_INIT = "normal(0, 1/sqrt(fan_in))"    # the default init, as the marker records it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
SMOLLM2_BOS, SMOLLM2_EOS = 1, 2


@dataclass(frozen=True)
class RandomPreset:
    """Architecture and shape of one preset (see the module table)."""

    arch: str                       # "llama" or "qwen3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int
    tie_word_embeddings: bool
    rope_theta: float

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen3"):
            raise ValueError(f"arch must be 'llama' or 'qwen3', got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads, got {self.num_heads}"
                             f" and {self.num_kv_heads}")


PRESETS: dict[str, RandomPreset] = {
    "smollm2-135m": RandomPreset("llama", 576, 30, 9, 3, 1536, 64, True, 100000.0),
    "llama-8b": RandomPreset("llama", 4096, 32, 32, 8, 14336, 128, False, 500000.0),
    "qwen3-0.6b": RandomPreset("qwen3", 1024, 28, 16, 8, 3072, 128, True, 1000000.0),
    "tiny-llama": RandomPreset("llama", 64, 2, 4, 2, 128, 16, True, 10000.0),
    "tiny-qwen3": RandomPreset("qwen3", 64, 2, 4, 2, 128, 16, True, 10000.0),
    # head_dim 64: the smallest head vLLM's CPU attention kernels take (the vLLM backend's tests)
    "tiny-llama-hd64": RandomPreset("llama", 128, 2, 2, 1, 256, 64, True, 10000.0),
}


def is_random_spec(model: str) -> bool:
    """True for ``random:<preset>[:<seed>]`` specs."""
    return isinstance(model, str) and model.startswith(RANDOM_PREFIX)


def parse_spec(model: str) -> tuple[str, int]:
    """``"random:llama-8b:3"`` -> ``("llama-8b", 3)``; the seed defaults to ``DEFAULT_SEED``.

    Raises:
        ValueError: not a random spec, unknown preset, or a seed that is not an int >= 0.
    """
    if not is_random_spec(model):
        raise ValueError(f"model spec must start with {RANDOM_PREFIX!r}, got {model!r}")
    preset, _, seed_text = model[len(RANDOM_PREFIX):].partition(":")
    if preset not in PRESETS:
        raise ValueError(f"unknown random preset {preset!r}; presets: {sorted(PRESETS)}")
    if not seed_text:
        return preset, DEFAULT_SEED
    if not seed_text.isdigit():
        raise ValueError(f"seed in {model!r} must be an int >= 0, got {seed_text!r}")
    return preset, int(seed_text)


def make_config(preset_name: str):
    """The transformers config of a preset (``LlamaConfig`` or ``Qwen3Config``), vocab 49152."""
    from transformers import LlamaConfig, Qwen3Config

    preset = PRESETS[preset_name]
    common = dict(
        vocab_size=RANDOM_VOCAB_SIZE, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=preset.tie_word_embeddings, bos_token_id=SMOLLM2_BOS,
        eos_token_id=SMOLLM2_EOS, pad_token_id=SMOLLM2_EOS,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
    )
    config_cls = LlamaConfig if preset.arch == "llama" else Qwen3Config
    return config_cls(**common)


def build_random_model(model: str, dtype: torch.dtype, device: str | torch.device,
                       init_std: float | None = None):
    """Build the causal LM of ``model`` (a random spec) with seeded random weights on ``device``.

    Returns:
        a ``PreTrainedModel`` in eval mode, ``dtype`` parameters on ``device`` (rotary
        ``inv_freq`` stays float32), sdpa attention (the loader switches it to slot attention).
        ``init_std`` None: ``1 / sqrt(fan_in)`` per matrix (module docstring), else that std.

    Raises:
        ValueError: bad spec (``parse_spec``) or ``init_std <= 0``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    preset, seed = parse_spec(model)
    if init_std is not None and not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    device = torch.device(device)
    config = make_config(preset)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config, dtype=dtype)
    net.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    _fill_parameters(net, init_std, generator)
    _rebuild_rotary(net, device)
    net.tie_weights()
    net.generation_config = GenerationConfig(
        bos_token_id=SMOLLM2_BOS, eos_token_id=SMOLLM2_EOS, pad_token_id=SMOLLM2_EOS)
    return net.eval()


def _fill_parameters(net: torch.nn.Module, init_std: float | None,
                     generator: torch.Generator) -> None:
    """Matrices/embeddings ~ N(0, std^2) in name order (std: ``init_std`` or
    ``shape[-1] ** -0.5``); 1-D norm weights 1, biases 0."""
    seen: set[int] = set()
    with torch.no_grad():
        for name, param in net.named_parameters(remove_duplicate=True):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if param.dim() >= 2:
                std = init_std if init_std is not None else param.shape[-1] ** -0.5
                param.normal_(0.0, std, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def _rebuild_rotary(net: torch.nn.Module, device: torch.device) -> None:
    """Recompute rotary ``inv_freq`` buffers (``to_empty`` left them uninitialised)."""
    for parent in list(net.modules()):
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq"):
                fresh = type(child)(child.config).to(device)
                setattr(parent, child_name, fresh)


def model_dir(model: str) -> str:
    """Local dir for a random spec (config, generation config, marker, tokenizer if found).

    Written once under ``$MINEDRAFT_CACHE/models`` (temp dir + rename, safe for racing
    processes).

    Raises:
        ValueError: bad spec.
    """
    preset, seed = parse_spec(model)
    final_dir = os.path.join(cache_root(), "models", f"random-{preset}-s{seed}")
    out_dir = build_cached_dir(final_dir, RANDOM_MARKER, lambda tmp_dir: _write_dir(tmp_dir, model, preset, seed))
    if not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        _add_tokenizer(out_dir)   # written before a tokenizer was found (e.g. by a Python without the GGUF)
    return out_dir


def _add_tokenizer(out_dir: str) -> None:
    """Copy the tokenizer files (``find_tokenizer_dir``) into a dir that lacks them, each through
    a temp name and a rename, so a racing reader sees a file whole or not at all."""
    tokenizer_src = find_tokenizer_dir()
    if tokenizer_src is None:
        return
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_src, name)
        if os.path.isfile(src):
            tmp = os.path.join(out_dir, f".{name}.{os.getpid()}.tmp")
            shutil.copy(src, tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, os.path.join(out_dir, name))


def _write_dir(out_dir: str, model: str, preset: str, seed: int) -> None:
    from transformers import GenerationConfig

    config = make_config(preset)
    # the causal-LM class by name: vLLM picks its model class (and task: generation) from this field
    config.architectures = ["LlamaForCausalLM" if PRESETS[preset].arch == "llama" else "Qwen3ForCausalLM"]
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=SMOLLM2_BOS, eos_token_id=SMOLLM2_EOS,
                     pad_token_id=SMOLLM2_EOS).save_pretrained(out_dir)
    tokenizer_src = find_tokenizer_dir()
    _add_tokenizer(out_dir)
    marker = {"spec": model, "preset": preset, "seed": seed, "init": FAN_IN_INIT,
              "weights": "random weights", "tokenizer_source": tokenizer_src}
    with open(os.path.join(out_dir, RANDOM_MARKER), "w") as fh:
        json.dump(marker, fh, indent=2)
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o644)


def find_tokenizer_dir() -> str | None:
    """``$MINEDRAFT_RANDOM_TOKENIZER``, else the SmolLM2 conversion's dir, else None."""
    env_dir = os.environ.get(TOKENIZER_ENV)
    if env_dir:
        if not os.path.isfile(os.path.join(env_dir, "tokenizer.json")):
            raise FileNotFoundError(f"${TOKENIZER_ENV}={env_dir} holds no tokenizer.json")
        return env_dir
    try:
        smollm2_dir = hf_model_dir(ModelConfig())  # the default alias: a GGUF, never a random spec
    except FileNotFoundError:
        return None
    return smollm2_dir if os.path.isfile(os.path.join(smollm2_dir, "tokenizer.json")) else None


def read_marker(dir_path: str) -> dict | None:
    """The marker of a random-model dir, or None for any other dir."""
    path = os.path.join(dir_path, RANDOM_MARKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)
