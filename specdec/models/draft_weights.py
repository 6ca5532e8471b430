"""Weight files of a MineDraft draft directory (``specdec.models.draft_format``): one
``model.safetensors``, or whole-tensor shards ``model-00001-of-0000N.safetensors`` (Hugging Face's
shard names) when the weights exceed ``MAX_SHARD_BYTES``, so no file of a committed draft is
over 16 MiB."""

from __future__ import annotations

import glob
import os

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

DRAFT_WEIGHTS_FILE = "model.safetensors"
DRAFT_SHARD_GLOB = "model-*-of-*.safetensors"
MAX_SHARD_BYTES = 16 * 1024**2


def draft_weight_files(draft_dir: str) -> list[str]:
    """Paths of the draft's weight files: ``DRAFT_WEIGHTS_FILE``, or its shards in order."""
    single = os.path.join(draft_dir, DRAFT_WEIGHTS_FILE)
    return [single] if os.path.isfile(single) else sorted(glob.glob(os.path.join(draft_dir, DRAFT_SHARD_GLOB)))


def read_draft_weights(draft_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the draft's weight file(s) (own weights and ``DRAFT_VOCAB_KEY``), on CPU.

    Raises:
        FileNotFoundError: ``draft_dir`` holds neither ``DRAFT_WEIGHTS_FILE`` nor shards of it.
    """
    paths = draft_weight_files(draft_dir)
    if not paths:
        raise FileNotFoundError(f"draft_dir: no {DRAFT_WEIGHTS_FILE} (or shards of it) in {draft_dir}")
    weights: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            weights.update({k: f.get_tensor(k) for k in f.keys()})
    return weights


def write_draft_weights(weights: dict[str, torch.Tensor], out_dir: str,
                        max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write ``weights`` as ``DRAFT_WEIGHTS_FILE`` when they fit in ``max_shard_bytes``, else as
    shards of whole tensors (``huggingface_hub.split_torch_state_dict_into_shards``: each shard
    within the limit unless one tensor alone exceeds it); weight files of an earlier save in
    ``out_dir`` are removed. Returns the paths."""
    split = split_torch_state_dict_into_shards(weights, max_shard_size=max_shard_bytes)
    for stale in draft_weight_files(out_dir):
        os.remove(stale)
    paths = []
    for name, keys in split.filename_to_tensors.items():
        paths.append(os.path.join(out_dir, name))
        save_file({key: weights[key] for key in keys}, paths[-1], metadata={"format": "pt"})
    return paths
