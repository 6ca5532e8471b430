"""Same-host draft-probs data plane (``--data-plane ipc``): shared buffers, no socket per step.

The drafter (``IpcProbsServer``) allocates a ring of ``num_slots`` probs slots once, in one
buffer on its device, and shares it (``specdec.dataplane_shm``: CUDA IPC handles on a GPU, a
/dev/shm file on CPU). A small CPU metadata file ``<SHM_DIR>/minedraft-<name>.meta`` holds the
buffer's descriptor and one header per slot. Verifier rank 0 (``IpcProbsClient``) maps both.

Per step (MineDraft paper §5: the verifier needs the draft distribution q [b, k, V]):
1. ``publish(step_id, request_ids, probs)``: slot ``step_id % num_slots``; its sequence word
   goes odd, probs are copied into the slot (same dtype, no conversion) and the drafter's CUDA
   stream is synchronised, the header (step id, b, k, V, dtype, request ids) is written, the
   sequence word goes even. Draft returns only after this, so the data is in place before the
   coordinator sends the Verify.
2. ``fetch(step_id, request_ids)``: read the slot's sequence word (even) and header, copy the
   rows into a fresh tensor on the verifier's device (a peer copy over NVLink between GPUs),
   synchronise, read the sequence word again: unchanged means the copy is consistent (a
   seqlock); else the step was overwritten (``DraftProbsMissingError``), as is a slot holding
   another step (never drafted sampled, or ``num_slots`` steps old).
The ring grows (a new buffer and descriptor, ``generation`` + 1) only if a step needs more
bytes than a slot holds; the client re-opens the buffer when it sees a new generation.
Word-by-word writes rely on in-order stores between processes (x86-64 TSO).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdec import dataplane_shm as shm
from specdec.dataplane_common import ID_SEPARATOR, DataPlaneUnavailableError, DraftProbsMissingError

PROBS_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAGIC = 0x4D494E4544524654  # "MINEDRFT"
_HDR_MAGIC, _HDR_INSTANCE, _HDR_GENERATION, _HDR_DESC_LEN, _HDR_NUM_SLOTS, _HDR_SLOT_BYTES, _HDR_IDS_BYTES = range(7)
_HEADER_WORDS = 8
_DESC_BYTES = 1024
_SLOT_SEQ, _SLOT_STEP, _SLOT_B, _SLOT_K, _SLOT_V, _SLOT_DTYPE, _SLOT_IDS_LEN = range(7)
_SLOT_WORDS = 8
_ALIGN = 256
_CONNECT_POLL_S = 0.05


@dataclass(frozen=True)
class IpcPlaneConfig:
    """Names and sizes of the IPC plane. Raises ValueError naming the field.

    Args:
        name: file name stem shared by drafter and verifier (``minedraft-<name>.meta``).
        device: the local end's torch device (drafter: where probs live; verifier: where they go).
        num_slots: steps kept in the ring (a step older than this is overwritten); the
            verifier takes the drafter's value from the metadata header.
        max_batch_size: rows a slot holds at first allocation (the drafter's ``max_num_seqs``).
        max_ids_bytes: utf-8 bytes of a step's NUL-separated request ids.
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
        return _HEADER_WORDS * 8 + _DESC_BYTES + self.num_slots * (_SLOT_WORDS * 8 + self.max_ids_bytes)


class _Meta:
    """numpy views (cheap scalar access) of the mapped metadata file: header words, descriptor
    bytes, per-slot words and request-id bytes."""

    def __init__(self, raw: torch.Tensor, cfg: IpcPlaneConfig) -> None:
        self.raw = raw  # keeps the mapping alive
        data = raw.numpy()
        self.header = data[: _HEADER_WORDS * 8].view(np.int64)
        self.desc = data[_HEADER_WORDS * 8: _HEADER_WORDS * 8 + _DESC_BYTES]
        base, stride = _HEADER_WORDS * 8 + _DESC_BYTES, _SLOT_WORDS * 8 + cfg.max_ids_bytes
        self.slots = [data[base + s * stride: base + s * stride + _SLOT_WORDS * 8].view(np.int64)
                      for s in range(cfg.num_slots)]
        self.ids = [data[base + s * stride + _SLOT_WORDS * 8: base + (s + 1) * stride] for s in range(cfg.num_slots)]


def _slot_bytes(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


def _sync(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


class IpcProbsServer:
    """Drafter side of the IPC plane (module protocol, step 1)."""

    def __init__(self, cfg: IpcPlaneConfig) -> None:
        self.cfg = cfg
        self._meta = _Meta(shm.create_file_buffer(cfg.meta_path, cfg.meta_bytes), cfg)
        self._buffer: torch.Tensor | None = None
        self._buffer_path: str | None = None
        self._lock = threading.Lock()
        self.is_connected = threading.Event()  # same surface as DraftProbsServer
        self.num_reallocations = 0
        header = self._meta.header
        header[_HDR_INSTANCE] = secrets.randbits(62)
        header[_HDR_NUM_SLOTS], header[_HDR_IDS_BYTES] = cfg.num_slots, cfg.max_ids_bytes
        header[_HDR_MAGIC] = MAGIC  # last: the file is complete

    def start(self) -> None:
        """Nothing to start: the metadata file exists from construction on."""
        self.is_connected.set()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Remove the shared files (an attached verifier keeps its mappings until it closes)."""
        self.is_connected.clear()
        for path in (self.cfg.meta_path, self._buffer_path):
            if path and os.path.exists(path):
                os.unlink(path)

    def _ensure_capacity(self, num_bytes: int, device: torch.device) -> None:
        if self._buffer is not None and self._meta.header[_HDR_SLOT_BYTES] >= num_bytes \
                and self._buffer.device == device:
            return
        slot_bytes = max(_slot_bytes(num_bytes), int(self._meta.header[_HDR_SLOT_BYTES]))
        generation = int(self._meta.header[_HDR_GENERATION]) + 1
        old_path = self._buffer_path
        self._buffer_path = os.path.join(shm.SHM_DIR, f"minedraft-{self.cfg.name}.g{generation}.buf")
        total = slot_bytes * self.cfg.num_slots
        self._buffer = shm.allocate(total, device, self._buffer_path)
        desc = shm.export(self._buffer) if device.type == "cuda" else shm.export_file(self._buffer_path, total)
        if len(desc) > _DESC_BYTES:
            raise ValueError(f"buffer descriptor of {len(desc)} bytes exceeds {_DESC_BYTES}")
        header = self._meta.header
        for slot in self._meta.slots:  # no slot of the old buffer stays valid
            slot[_SLOT_STEP] = -1
        self._meta.desc[: len(desc)] = np.frombuffer(desc, dtype=np.uint8)
        header[_HDR_DESC_LEN] = len(desc)
        header[_HDR_SLOT_BYTES] = slot_bytes
        header[_HDR_GENERATION] = generation  # last: the client re-opens on a new generation
        self.num_reallocations += 1
        if old_path and os.path.exists(old_path) and device.type != "cuda":
            os.unlink(old_path)

    def publish(self, step_id: int, request_ids: list[str], probs: torch.Tensor) -> None:
        """Write ``probs`` [b, k, V] of ``request_ids`` (len b) into the slot of ``step_id``.

        Raises:
            ValueError: shape/ids mismatch, unsupported dtype, NUL in an id, ids over ``max_ids_bytes``.
        """
        if probs.dim() != 3 or probs.shape[0] != len(request_ids):
            raise ValueError(f"probs must be [b={len(request_ids)}, k, V], got {tuple(probs.shape)}")
        if probs.dtype not in PROBS_DTYPES:
            raise ValueError(f"probs dtype {probs.dtype} not supported by the ipc plane")
        if any(ID_SEPARATOR in rid for rid in request_ids):
            raise ValueError("request ids must not contain NUL")
        id_bytes = ID_SEPARATOR.join(request_ids).encode()
        if len(id_bytes) > self.cfg.max_ids_bytes:
            raise ValueError(f"request ids take {len(id_bytes)} bytes, max_ids_bytes is {self.cfg.max_ids_bytes}")
        b, k, vocab = probs.shape
        num_bytes = probs.numel() * probs.element_size()
        rows = max(b, self.cfg.max_batch_size)
        with self._lock:
            self._ensure_capacity(rows * k * vocab * probs.element_size(), probs.device)
            slot_index = step_id % self.cfg.num_slots
            words, slot_bytes = self._meta.slots[slot_index], int(self._meta.header[_HDR_SLOT_BYTES])
            words[_SLOT_SEQ] += 1  # odd: being written
            start = slot_index * slot_bytes
            self._buffer[start: start + num_bytes].view(probs.dtype).view(b, k, vocab).copy_(probs)
            _sync(self._buffer)
            if id_bytes:
                self._meta.ids[slot_index][: len(id_bytes)] = np.frombuffer(id_bytes, dtype=np.uint8)
            words[_SLOT_STEP], words[_SLOT_B], words[_SLOT_K], words[_SLOT_V] = step_id, b, k, vocab
            words[_SLOT_DTYPE], words[_SLOT_IDS_LEN] = PROBS_DTYPES.index(probs.dtype), len(id_bytes)
            words[_SLOT_SEQ] += 1  # even: complete


class IpcProbsClient:
    """Verifier rank 0 side of the IPC plane (module protocol, step 2)."""

    def __init__(self, cfg: IpcPlaneConfig) -> None:
        self.cfg = cfg
        self._meta: _Meta | None = None
        self._buffer: torch.Tensor | None = None
        self._instance = self._generation = None
        self._lock = threading.Lock()

    @property
    def is_connected(self) -> bool:
        return self._meta is not None

    def connect(self) -> None:
        """Map the drafter's metadata file; waits up to ``connect_timeout_s`` for it.

        Raises:
            DataPlaneUnavailableError: no complete metadata file in time.
        """
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        while self._meta is None:
            meta = self._try_open()
            if meta is not None:
                self._meta, self._instance = meta, int(meta.header[_HDR_INSTANCE])
                return
            if time.monotonic() > deadline:
                raise DataPlaneUnavailableError(f"no drafter ipc plane at {self.cfg.meta_path}")
            time.sleep(_CONNECT_POLL_S)

    def _try_open(self) -> _Meta | None:
        """The metadata views, sized by the drafter's header (its num_slots, max_ids_bytes)."""
        path = self.cfg.meta_path
        try:
            if os.path.getsize(path) < _HEADER_WORDS * 8:
                return None
            header = torch.from_file(path, shared=True, size=_HEADER_WORDS, dtype=torch.int64).numpy()
            if int(header[_HDR_MAGIC]) != MAGIC:
                return None
            self.cfg = replace(self.cfg, num_slots=int(header[_HDR_NUM_SLOTS]),
                               max_ids_bytes=int(header[_HDR_IDS_BYTES]))
            return _Meta(torch.from_file(path, shared=True, size=self.cfg.meta_bytes, dtype=torch.uint8), self.cfg)
        except (OSError, RuntimeError):
            return None

    def start_connect(self) -> None:
        """``connect`` happens lazily at the first fetch (it only maps a file)."""

    def _open_buffer(self) -> None:
        header = self._meta.header
        if int(header[_HDR_INSTANCE]) != self._instance:
            raise DataPlaneUnavailableError("the drafter's ipc plane was restarted; reconnect")
        generation = int(header[_HDR_GENERATION])
        if generation == 0:
            raise DraftProbsMissingError("the drafter has published no draft probs yet")
        if generation != self._generation:
            desc = self._meta.desc[: int(header[_HDR_DESC_LEN])].tobytes()
            self._buffer, self._generation = shm.open_shared(desc), generation

    def fetch(self, step_id: int, request_ids: list[str]) -> torch.Tensor:
        """Draft probs [len(request_ids), k, V] (the drafter's dtype) of ``step_id`` on
        ``cfg.device``, rows in ``request_ids`` order (a copy; the slot may be reused later).

        Raises:
            DataPlaneUnavailableError: no drafter plane; DraftProbsMissingError: the slot holds
            another step, was overwritten during the copy, or lacks a request id.
        """
        with self._lock:
            if self._meta is None:
                self.connect()
            self._open_buffer()
            slot_index = step_id % self.cfg.num_slots
            words = self._meta.slots[slot_index]
            seq = int(words[_SLOT_SEQ])
            step, b, k, vocab, code, ids_len = words[_SLOT_STEP:_SLOT_IDS_LEN + 1].tolist()
            if seq % 2 or step != step_id:
                raise DraftProbsMissingError(f"drafter holds no draft probs for step {step_id}")
            ids = self._meta.ids[slot_index][:ids_len].tobytes().decode().split(ID_SEPARATOR) if ids_len else []
            rows = self._rows(step_id, ids, request_ids)
            dtype = PROBS_DTYPES[code]
            start = slot_index * int(self._meta.header[_HDR_SLOT_BYTES])
            size = b * k * vocab * torch.empty((), dtype=dtype).element_size()
            view = self._buffer[start: start + size].view(dtype).view(b, k, vocab)
            probs = view.to(self.cfg.device, copy=True) if rows is None else view[rows.to(view.device)].to(self.cfg.device)
            _sync(view)  # the drafter's device (a peer copy runs on both) ...
            _sync(probs)  # ... and ours
            if int(words[_SLOT_SEQ]) != seq:
                raise DraftProbsMissingError(f"draft step {step_id} was overwritten while it was read")
            return probs

    @staticmethod
    def _rows(step_id: int, drafted_ids: list[str], request_ids: list[str]) -> torch.Tensor | None:
        row_of = {rid: row for row, rid in enumerate(drafted_ids)}
        missing = [rid for rid in request_ids if rid not in row_of]
        if missing:
            raise DraftProbsMissingError(f"draft step {step_id} has no probs for request ids {missing}")
        rows = [row_of[rid] for rid in request_ids]
        return None if rows == list(range(len(drafted_ids))) else torch.tensor(rows, dtype=torch.long)

    def close(self) -> None:
        """Drop the mappings."""
        with self._lock:
            self._meta = self._buffer = None
            self._generation = None
