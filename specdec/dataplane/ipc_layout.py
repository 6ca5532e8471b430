"""Layout of the IPC data plane's shared metadata file (``specdec.dataplane.ipc``) and its config.

File ``<SHM_DIR>/minedraft-<name>.meta``: ``HEADER_WORDS`` int64 header words (magic, drafter
instance id, buffer generation, descriptor length, num_slots, slot bytes, max_ids_bytes), the
probs buffer's descriptor (``DESC_BYTES``), then per slot ``SLOT_WORDS`` int64 words (sequence,
step id, b, k, V, dtype code, ids length) and ``max_ids_bytes`` of NUL-separated request ids
followed by the b rows' numbers of draft tokens k_i (little-endian int32 each; ragged rows: the
probs past k_i are zero padding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from specdec.dataplane import shm

PROBS_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAGIC = 0x4D494E4544524654  # "MINEDRFT"
HDR_MAGIC, HDR_INSTANCE, HDR_GENERATION, HDR_DESC_LEN, HDR_NUM_SLOTS, HDR_SLOT_BYTES, HDR_IDS_BYTES = range(7)
HEADER_WORDS = 8
DESC_BYTES = 1024
SLOT_SEQ, SLOT_STEP, SLOT_B, SLOT_K, SLOT_V, SLOT_DTYPE, SLOT_IDS_LEN = range(7)
SLOT_WORDS = 8
ROW_K_BYTES = 4  # int32 k_i per row, after the request ids
ALIGN = 256


@dataclass(frozen=True)
class IpcPlaneConfig:
    """Names and sizes of the IPC plane. Raises ValueError naming the field.

    Args:
        name: file name stem shared by drafter and verifier (``minedraft-<name>.meta``).
        device: the local end's torch device (drafter: where probs live; verifier: where they go).
        num_slots: steps kept in the ring (a step older than this is overwritten); the
            verifier takes the drafter's value from the metadata header.
        max_batch_size: rows a slot holds at first allocation (the drafter's ``max_num_seqs``).
        max_ids_bytes: utf-8 bytes of a step's NUL-separated request ids plus 4 per row (its k_i).
        connect_timeout_s: how long the verifier waits for the drafter's metadata file.
    """

    name: str = "minedraft"
    device: str = "cpu"
    num_slots: int = 8
    max_batch_size: int = 16
    max_ids_bytes: int = 16384
    connect_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"name must be a non-empty file name stem, got {self.name!r}")
        for field in ("num_slots", "max_batch_size", "max_ids_bytes"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")

    @property
    def meta_path(self) -> str:
        return os.path.join(shm.SHM_DIR, f"minedraft-{self.name}.meta")

    @property
    def meta_bytes(self) -> int:
        return HEADER_WORDS * 8 + DESC_BYTES + self.num_slots * (SLOT_WORDS * 8 + self.max_ids_bytes)


class Meta:
    """numpy views (cheap scalar access) of the mapped metadata file: header words, descriptor
    bytes, per-slot words and request-id bytes."""

    def __init__(self, raw: torch.Tensor, cfg: IpcPlaneConfig) -> None:
        self.raw = raw  # keeps the mapping alive
        data = raw.numpy()
        self.header = data[: HEADER_WORDS * 8].view(np.int64)
        self.desc = data[HEADER_WORDS * 8: HEADER_WORDS * 8 + DESC_BYTES]
        base, stride = HEADER_WORDS * 8 + DESC_BYTES, SLOT_WORDS * 8 + cfg.max_ids_bytes
        self.slots = [data[base + s * stride: base + s * stride + SLOT_WORDS * 8].view(np.int64)
                      for s in range(cfg.num_slots)]
        self.ids = [data[base + s * stride + SLOT_WORDS * 8: base + (s + 1) * stride] for s in range(cfg.num_slots)]


def aligned_bytes(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN
