"""``resolve_model_dir``: any model spec MineDraft accepts -> a local Hugging Face model dir.

A random spec ``random:<preset>[:<seed>]`` resolves to a small dir of config + tokenizer
(``specdec.models.random_models.model_dir``); anything else (alias, HF dir, GGUF file) through
``specdec.models.gguf.hf_model_dir``.
"""

from __future__ import annotations

from specdec.config import ModelConfig
from specdec.models.gguf import hf_model_dir
from specdec.models.random_models import is_random_spec
from specdec.models.random_models import model_dir as random_model_dir


def resolve_model_dir(cfg: ModelConfig) -> str:
    """Local HF dir for ``cfg.model`` (alias, HF dir, GGUF, or random spec), converting a GGUF once.

    ``load_model`` (``specdec.models.loader``) fills a random spec's dir with seeded random weights.

    Raises:
        FileNotFoundError: the alias's package is not installed, or the path does not exist or
            holds neither an HF model nor a GGUF file.
        ValueError: a random spec with an unknown preset or a bad seed.
    """
    if is_random_spec(cfg.model):
        return random_model_dir(cfg.model)
    return hf_model_dir(cfg)
