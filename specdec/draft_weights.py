"""Weight files of a MineDraft draft directory (``specdec.draft_format``): one
``model.safetensors``, or whole-tensor shards ``model-00001-of-0000N.safetensors`` (Hugging Face's
shard names) when the weights exceed ``MAX_SHARD_BYTES``, so no file of a committed draft is
over 16 MiB."""

from __future__ import annotations

import glob
import os

import torch
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
    shards of whole tensors (in key order, each shard within the limit unless one tensor alone
    exceeds it); weight files of an earlier save in ``out_dir`` are removed. Returns the paths."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in weights.items():
        num_bytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + num_bytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += num_bytes
    for stale in draft_weight_files(out_dir):
        os.remove(stale)
    names = [DRAFT_WEIGHTS_FILE] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    paths = [os.path.join(out_dir, name) for name in names]
    for shard, path in zip(shards, paths):
        save_file(shard, path, metadata={"format": "pt"})
    return paths
