"""Memory footprints: model weights and preallocated KV caches against available memory.

Torch-free (used by the launcher before any engine starts, and by drafter_svc before it loads
its model): weights are counted from the safetensors headers (8-byte little-endian header
length, then a JSON map of tensor name -> dtype/shape; https://github.com/huggingface/safetensors),
the KV cache from ``config.json`` exactly as ``specdec.kv.kv_cache.SlotKVCache`` allocates it:
``2 (k, v) x num_layers x max_num_seqs x num_kv_heads x max_model_len x head_dim x dtype bytes``.
A MineDraft draft dir (``minedraft_draft.json``) borrows the target's embeddings (and LM head
when untied), which are counted too. Available memory is ``psutil.virtual_memory().available``.
A configuration that cannot fit fails at start with :class:`InsufficientMemoryError`, never
mid-traffic (DESIGN.md §5, paper §A: drafter-side KV was never counted).
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DRAFT_META_FILE = "minedraft_draft.json"
EMBED_KEY_SUFFIX = "embed_tokens.weight"
GIB = 1024**3


class InsufficientMemoryError(RuntimeError):
    """The models and KV caches of a configuration do not fit in the available memory."""


@dataclass(frozen=True)
class Footprint:
    """Memory one engine will hold (bytes).

    Raises:
        ValueError: a negative size (the message names the field).
    """

    name: str
    weight_bytes: int
    kv_cache_bytes: int

    def __post_init__(self) -> None:
        for field in ("weight_bytes", "kv_cache_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field}: must be >= 0, got {getattr(self, field)}")

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes


def num_safetensors_params(model_dir: str) -> tuple[int, bool]:
    """(number of parameters in ``model_dir/*.safetensors``, whether an embedding table is among them).

    Raises:
        FileNotFoundError: no safetensors file. ValueError: a malformed header.
    """
    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"model_dir: no *.safetensors in {model_dir}")
    num_params, has_embed = 0, False
    for path in paths:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            try:
                header = json.loads(f.read(header_len))
            except json.JSONDecodeError as exc:
                raise ValueError(f"model_dir: bad safetensors header in {path}: {exc}") from exc
        for name, entry in header.items():
            if name != "__metadata__":
                num_params += math.prod(entry["shape"])
                has_embed = has_embed or name.endswith(EMBED_KEY_SUFFIX)
    return num_params, has_embed


def model_footprint(name: str, model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int) -> Footprint:
    """Weights + KV cache of the model in ``model_dir`` (an HF safetensors dir or a MineDraft draft dir).

    Args:
        dtype: parameter and KV dtype ("float32", "bfloat16", ...).
        max_num_seqs, max_model_len: KV slots and tokens per slot.

    Raises:
        ValueError: unknown dtype. FileNotFoundError: no config.json / safetensors.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config = config.get("text_config", config)
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    itemsize = DTYPE_BYTES[dtype]
    kv_bytes = 2 * config["num_hidden_layers"] * max_num_seqs * num_kv_heads * max_model_len * head_dim * itemsize
    num_params, has_embed = num_safetensors_params(model_dir)
    if os.path.isfile(os.path.join(model_dir, DRAFT_META_FILE)) and not has_embed:
        num_tables = 1 if config.get("tie_word_embeddings", True) else 2  # borrowed from the target
        num_params += num_tables * config["vocab_size"] * config["hidden_size"]
    return Footprint(name, num_params * itemsize, kv_bytes)


def available_bytes() -> int:
    """Memory available to new allocations now (``psutil.virtual_memory().available``)."""
    return int(psutil.virtual_memory().available)


def check_fits(footprints: Sequence[Footprint], available: int | None = None) -> int:
    """Return the total bytes of ``footprints`` if they fit in ``available`` (default: psutil's).

    Raises:
        InsufficientMemoryError: with every part in GiB and what to lower.
    """
    available = available_bytes() if available is None else available
    total = sum(f.total_bytes for f in footprints)
    if total > available:
        parts = " + ".join(f"{f.name} weights {f.weight_bytes / GIB:.2f} GiB + {f.name} KV cache "
                           f"{f.kv_cache_bytes / GIB:.2f} GiB" for f in footprints)
        raise InsufficientMemoryError(
            f"not enough memory: {parts} = {total / GIB:.2f} GiB > {available / GIB:.2f} GiB available; "
            "lower --max-num-seqs or --max-model-len, or use --dtype bfloat16")
    return total
