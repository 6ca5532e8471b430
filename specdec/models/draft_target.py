"""What a MineDraft draft borrows from its target: the token embeddings / LM head and their fingerprint.

A draft directory (``specdec.models.draft_format``) stores only its own layers; the embeddings
``[vocab, hidden]`` and LM head come from the named target at load time. The fingerprint recorded
at training time (shape, sha256 of the bf16 embedding bytes, ``NUM_PROBE_ROWS`` projections)
makes a draft refuse a target whose embeddings differ (``IncompatibleDraftError``).
"""

from __future__ import annotations

import hashlib
import os

import torch
from safetensors import safe_open

from specdec.errors import IncompatibleDraftError

NUM_PROBE_ROWS = 64
PROBE_SEED = 1234
PROBE_RTOL = 1e-2  # bf16 vs fp32 storage of the same target stays far inside this
EMBED_KEY_SUFFIX = "embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"


def embedding_fingerprint(embed: torch.Tensor) -> dict:
    """Cheap identity of a target: shape, sha256 of its bf16 embedding bytes, and a probe.

    Args:
        embed: token embedding matrix ``[vocab, hidden]``, any float dtype/device.
    Returns:
        ``{"shape", "sha256_bf16", "probe"}``; ``probe`` = ``NUM_PROBE_ROWS`` projections of
        evenly spaced rows on a fixed random direction, tolerant to storage dtype (fp32/bf16).
    """
    weight = embed.detach().to("cpu", torch.float32)
    digest = hashlib.sha256(weight.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return {"shape": list(weight.shape), "sha256_bf16": digest.hexdigest(), "probe": _probe(weight)}


def _probe(weight: torch.Tensor) -> list[float]:
    gen = torch.Generator().manual_seed(PROBE_SEED)
    direction = torch.randn(weight.shape[1], generator=gen, dtype=torch.float64)
    rows = torch.linspace(0, weight.shape[0] - 1, NUM_PROBE_ROWS).long()
    return (weight[rows].double() @ direction).tolist()


def check_fingerprint(expected: dict, embed: torch.Tensor) -> None:
    """Raise IncompatibleDraftError unless ``embed`` is the embedding the draft was trained on."""
    actual = embedding_fingerprint(embed)
    if list(expected["shape"]) != actual["shape"]:
        raise IncompatibleDraftError(f"target embedding shape {actual['shape']} != {expected['shape']}")
    if expected["sha256_bf16"] == actual["sha256_bf16"]:
        return
    want, got = torch.tensor(expected["probe"]), torch.tensor(actual["probe"])
    scale = want.abs().mean().clamp_min(1e-12)
    if not torch.allclose(got, want, rtol=PROBE_RTOL, atol=PROBE_RTOL * float(scale)):
        raise IncompatibleDraftError(
            "the target's token embeddings do not match the ones this draft was trained with "
            f"(sha256 {actual['sha256_bf16'][:12]} != {expected['sha256_bf16'][:12]})"
        )


def read_target_embeddings(target_dir: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read ``embed_tokens.weight`` and ``lm_head.weight`` (None if tied/absent) from safetensors.

    Raises FileNotFoundError when ``target_dir`` holds no safetensors file with the embeddings.
    """
    embed, head = None, None
    for name in sorted(os.listdir(target_dir)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(target_dir, name), framework="pt") as f:
            for key in f.keys():
                if key.endswith(EMBED_KEY_SUFFIX) and embed is None:
                    embed = f.get_tensor(key)
                elif key == LM_HEAD_KEY:
                    head = f.get_tensor(key)
    if embed is None:
        raise FileNotFoundError(f"no '{EMBED_KEY_SUFFIX}' in safetensors files of {target_dir}")
    return embed, head
