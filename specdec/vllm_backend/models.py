"""Which Hugging Face dir (and vLLM ``load_format``) serves a model spec on the vLLM backend.

- ``random:<preset>[:<seed>]``, or such a preset's dir (``minedraft_random.json``): its config dir (``specdec.models.random_models``) with
  ``load_format="dummy"``: vLLM's own random init of that shape (RANDOM weights: outputs are
  meaningless, and acceptance is near zero unless a benchmark fixes it);
- a MineDraft draft dir (``minedraft_draft.json``: its own layers, the target's embeddings and
  head): exported once as a standalone ``LlamaForCausalLM`` (``specdec.models.hf_export.export_draft``,
  full-vocabulary head) under ``$MINEDRAFT_CACHE/vllm_drafts/<key>``; needs the target dir;
- anything else (alias, GGUF, HF dir): ``specdec.models.loader.resolve_model_dir`` (GGUF converted once).
"""

from __future__ import annotations

import hashlib
import os

from specdec.config import ModelConfig
from specdec.models.draft_format import DRAFT_META_FILE
from specdec.models.hf_export import EXPORT_META_FILE, export_draft
from specdec.models.cache import build_cached_dir, cache_root
from specdec.models.resolve import resolve_model_dir
from specdec.models.random_models import is_random_spec, model_dir as random_model_dir, read_marker


def resolve_vllm_model(model: str, target_dir: str | None = None) -> tuple[str, str]:
    """(local HF dir, vLLM load format) of ``model`` (see module docstring).

    Raises:
        ValueError: a MineDraft draft dir without ``target_dir``.
        FileNotFoundError / IncompatibleDraftError: as ``specdec.models.hf_export.export_draft``.
    """
    if is_random_spec(model):
        return random_model_dir(model), "dummy"
    if os.path.isdir(model) and read_marker(model) is not None:
        return model, "dummy"
    if os.path.isfile(os.path.join(model, DRAFT_META_FILE)):
        if target_dir is None:
            raise ValueError(f"draft {model!r} borrows the target's embeddings: the target model must be given")
        return _exported_draft(model, target_dir), "auto"
    return resolve_model_dir(ModelConfig(model=model)), "auto"


def _exported_draft(draft_dir: str, target_dir: str) -> str:
    """The cached export of ``draft_dir`` over ``target_dir`` (rebuilt when either changes)."""
    stamps = [os.path.abspath(draft_dir), os.path.abspath(target_dir)]
    for d in (draft_dir, target_dir):
        stamps += [f"{name}:{os.path.getmtime(os.path.join(d, name))}" for name in sorted(os.listdir(d))]
    key = hashlib.sha1("\n".join(stamps).encode()).hexdigest()[:12]
    final_dir = os.path.join(cache_root(), "vllm_drafts", f"{os.path.basename(os.path.normpath(draft_dir))}-{key}")
    return build_cached_dir(final_dir, EXPORT_META_FILE, lambda tmp: export_draft(draft_dir, target_dir, tmp))
