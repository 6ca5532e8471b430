"""Same-host draft-probs data plane (``--data-plane ipc``): shared buffers, no socket per step.

The drafter (``IpcProbsServer``) allocates a ring of ``num_slots`` probs slots once, in one
buffer on its device, and shares it (``specdec.dataplane.shm``: CUDA IPC handles on a GPU, a
/dev/shm file on CPU). A small CPU metadata file ``<SHM_DIR>/minedraft-<name>.meta`` holds the
buffer's descriptor and one header per slot. Verifier rank 0 (``IpcProbsClient``) maps both.

Per step (MineDraft paper §5: the verifier needs the draft distribution q [b, k, V]):
1. ``publish(step_id, request_ids, probs)``: slot ``step_id % num_slots``; its sequence word
   goes odd, probs are copied into the slot (same dtype, no conversion) and the drafter's CUDA
   stream is synchronised, the header (step id, b, k, V, dtype, request ids, per-row k_i) is written, the
   sequence word goes even. Draft returns only after this, so the data is in place before the
   coordinator sends the Verify.
2. ``fetch(step_id, request_ids)``: read the slot's sequence word (even) and header, copy the
   rows into a fresh tensor on the verifier's device (a peer copy over NVLink between GPUs),
   synchronise, read the sequence word again: unchanged means the copy is consistent (a
   seqlock); else the step was overwritten (``DraftProbsMissingError``), as is a slot holding
   another step (never drafted sampled, or ``num_slots`` steps old).
The ring grows (a new buffer and descriptor, ``generation`` + 1) only if a step needs more
bytes than a slot holds; the client re-opens the buffer when it sees a new generation.
The rows' published k_i must equal the ones the Verify expects (``num_draft_tokens``), else
ValueError: ragged rows described otherwise would read padding as drafts.
Word-by-word writes rely on in-order stores between processes (x86-64 TSO).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import replace

import numpy as np
import torch

from specdec.dataplane import shm
from specdec.dataplane.common import (
    ID_SEPARATOR, DataPlaneUnavailableError, DraftProbsMissingError, check_probs, check_row_ks,
)
from specdec.dataplane.ipc_layout import (  # noqa: F401 (IpcPlaneConfig, PROBS_DTYPES: public here too)
    DESC_BYTES, HDR_DESC_LEN, HDR_GENERATION, HDR_IDS_BYTES, HDR_INSTANCE, HDR_MAGIC, HDR_NUM_SLOTS,
    HDR_SLOT_BYTES, HEADER_WORDS, MAGIC, PROBS_DTYPES, ROW_K_BYTES, SLOT_B, SLOT_DTYPE, SLOT_IDS_LEN, SLOT_K, SLOT_SEQ,
    SLOT_STEP, SLOT_V, IpcPlaneConfig, Meta, aligned_bytes,
)

_CONNECT_POLL_S = 0.05


def _unlink_if_same(path: str, inode: int) -> None:
    """Remove ``path`` unless it is gone or another process's newer file (a restarted drafter)."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _sync(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


class IpcProbsServer:
    """Drafter side of the IPC plane (module protocol, step 1)."""

    def __init__(self, cfg: IpcPlaneConfig) -> None:
        self.cfg = cfg
        self._meta = Meta(shm.create_file_buffer(cfg.meta_path, cfg.meta_bytes), cfg)
        self._own_inodes = {cfg.meta_path: os.stat(cfg.meta_path).st_ino}
        self._buffer: torch.Tensor | None = None
        self._buffer_path: str | None = None
        self._lock = threading.Lock()
        self.is_connected = threading.Event()  # same surface as DraftProbsServer
        self.num_reallocations = 0
        header = self._meta.header
        header[HDR_INSTANCE] = secrets.randbits(62)
        header[HDR_NUM_SLOTS], header[HDR_IDS_BYTES] = cfg.num_slots, cfg.max_ids_bytes
        header[HDR_MAGIC] = MAGIC  # last: the file is complete

    def start(self) -> None:
        """Nothing to start: the metadata file exists from construction on."""
        self.is_connected.set()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Remove the shared files (an attached verifier keeps its mappings until it closes)."""
        self.is_connected.clear()
        for path, inode in self._own_inodes.items():
            _unlink_if_same(path, inode)

    def _ensure_capacity(self, num_bytes: int, device: torch.device) -> None:
        if self._buffer is not None and self._meta.header[HDR_SLOT_BYTES] >= num_bytes \
                and self._buffer.device == device:
            return
        slot_bytes = max(aligned_bytes(num_bytes), int(self._meta.header[HDR_SLOT_BYTES]))
        generation = int(self._meta.header[HDR_GENERATION]) + 1
        old_path = self._buffer_path
        self._buffer_path = os.path.join(shm.SHM_DIR, f"minedraft-{self.cfg.name}.g{generation}.buf")
        total = slot_bytes * self.cfg.num_slots
        self._buffer = shm.allocate(total, device, self._buffer_path)
        if device.type != "cuda":
            self._own_inodes[self._buffer_path] = os.stat(self._buffer_path).st_ino
        desc = shm.export(self._buffer) if device.type == "cuda" else shm.export_file(self._buffer_path, total)
        if len(desc) > DESC_BYTES:
            raise ValueError(f"buffer descriptor of {len(desc)} bytes exceeds {DESC_BYTES}")
        header = self._meta.header
        for slot in self._meta.slots:  # no slot of the old buffer stays valid
            slot[SLOT_STEP] = -1
        self._meta.desc[: len(desc)] = np.frombuffer(desc, dtype=np.uint8)
        header[HDR_DESC_LEN] = len(desc)
        header[HDR_SLOT_BYTES] = slot_bytes
        header[HDR_GENERATION] = generation  # last: the client re-opens on a new generation
        self.num_reallocations += 1
        if old_path in self._own_inodes:
            _unlink_if_same(old_path, self._own_inodes.pop(old_path))

    def publish(self, step_id: int, request_ids: list[str], probs: torch.Tensor,
                num_draft_tokens: list[int] | None = None) -> None:
        """Write ``probs`` [b, k, V] of ``request_ids`` (len b) and the rows' k_i
        ``num_draft_tokens`` (b values in [0, k]; None: k for all) into the slot of ``step_id``.

        Raises:
            ValueError: shape/ids/k_i mismatch, unsupported dtype, NUL in an id, ids and k_i
            over ``max_ids_bytes``.
        """
        ks = check_probs(request_ids, probs, PROBS_DTYPES, "ipc", num_draft_tokens)
        id_bytes = ID_SEPARATOR.join(request_ids).encode()
        if len(id_bytes) + ROW_K_BYTES * len(ks) > self.cfg.max_ids_bytes:
            raise ValueError(f"request ids take {len(id_bytes)} bytes (+{ROW_K_BYTES} per row), "
                             f"max_ids_bytes is {self.cfg.max_ids_bytes}")
        b, k, vocab = probs.shape
        num_bytes = probs.numel() * probs.element_size()
        rows = max(b, self.cfg.max_batch_size)
        with self._lock:
            self._ensure_capacity(rows * k * vocab * probs.element_size(), probs.device)
            slot_index = step_id % self.cfg.num_slots
            words, slot_bytes = self._meta.slots[slot_index], int(self._meta.header[HDR_SLOT_BYTES])
            words[SLOT_SEQ] += 1  # odd: being written
            start = slot_index * slot_bytes
            self._buffer[start: start + num_bytes].view(probs.dtype).view(b, k, vocab).copy_(probs)
            _sync(self._buffer)
            row_ks = np.asarray(ks, dtype="<i4").tobytes()
            self._meta.ids[slot_index][: len(id_bytes) + len(row_ks)] = np.frombuffer(id_bytes + row_ks, dtype=np.uint8)
            words[SLOT_STEP], words[SLOT_B], words[SLOT_K], words[SLOT_V] = step_id, b, k, vocab
            words[SLOT_DTYPE], words[SLOT_IDS_LEN] = PROBS_DTYPES.index(probs.dtype), len(id_bytes)
            words[SLOT_SEQ] += 1  # even: complete


class IpcProbsClient:
    """Verifier rank 0 side of the IPC plane (module protocol, step 2)."""

    def __init__(self, cfg: IpcPlaneConfig) -> None:
        self.cfg = cfg
        self._meta: Meta | None = None
        self._buffer: torch.Tensor | None = None
        self._instance = self._generation = self._inode = None
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
            inode = self._meta_inode()
            meta = self._try_open() if inode is not None else None
            if meta is not None:
                self._meta, self._instance, self._inode = meta, int(meta.header[HDR_INSTANCE]), inode
                return
            if time.monotonic() > deadline:
                raise DataPlaneUnavailableError(f"no drafter ipc plane at {self.cfg.meta_path}")
            time.sleep(_CONNECT_POLL_S)

    def _try_open(self) -> Meta | None:
        """The metadata views, sized by the drafter's header (its num_slots, max_ids_bytes)."""
        path = self.cfg.meta_path
        try:
            if os.path.getsize(path) < HEADER_WORDS * 8:
                return None
            header = torch.from_file(path, shared=True, size=HEADER_WORDS, dtype=torch.int64).numpy()
            if int(header[HDR_MAGIC]) != MAGIC:
                return None
            self.cfg = replace(self.cfg, num_slots=int(header[HDR_NUM_SLOTS]),
                               max_ids_bytes=int(header[HDR_IDS_BYTES]))
            return Meta(torch.from_file(path, shared=True, size=self.cfg.meta_bytes, dtype=torch.uint8), self.cfg)
        except (OSError, RuntimeError):
            return None

    def _meta_inode(self) -> int | None:
        try:
            return os.stat(self.cfg.meta_path).st_ino
        except FileNotFoundError:
            return None

    def _follow_restart(self) -> None:
        """Re-map when the drafter restarted (its metadata file is a new inode); a drafter that
        stopped removed the file: DataPlaneUnavailableError."""
        inode = self._meta_inode()
        if inode is None:
            raise DataPlaneUnavailableError(f"the drafter's ipc plane {self.cfg.meta_path} is gone")
        if inode != self._inode:
            self._meta = self._buffer = self._generation = None
            self.connect()

    def start_connect(self) -> None:
        """``connect`` happens lazily at the first fetch (it only maps a file)."""

    def _open_buffer(self) -> None:
        header = self._meta.header
        if int(header[HDR_INSTANCE]) != self._instance:
            raise DataPlaneUnavailableError("the drafter's ipc plane was restarted during the fetch")
        generation = int(header[HDR_GENERATION])
        if generation == 0:
            raise DraftProbsMissingError("the drafter has published no draft probs yet")
        if generation != self._generation:
            desc = self._meta.desc[: int(header[HDR_DESC_LEN])].tobytes()
            self._buffer, self._generation = shm.open_shared(desc), generation

    def fetch(self, step_id: int, request_ids: list[str], num_draft_tokens: list[int] | None = None) -> torch.Tensor:
        """Draft probs [len(request_ids), k, V] (the drafter's dtype) of ``step_id`` on
        ``cfg.device``, rows in ``request_ids`` order (a copy; the slot may be reused later);
        ``num_draft_tokens``: the k_i the caller expects of those rows (None: not checked).

        Raises:
            DataPlaneUnavailableError: no drafter plane; DraftProbsMissingError: the slot holds
            another step, was overwritten during the copy, or lacks a request id.
            ValueError: a fetched row was drafted with another k_i than ``num_draft_tokens`` says.
        """
        with self._lock:
            if self._meta is None:
                self.connect()
            else:
                self._follow_restart()
            self._open_buffer()
            slot_index = step_id % self.cfg.num_slots
            words = self._meta.slots[slot_index]
            seq = int(words[SLOT_SEQ])
            step, b, k, vocab, code, ids_len = words[SLOT_STEP:SLOT_IDS_LEN + 1].tolist()
            if seq % 2 or step != step_id:
                raise DraftProbsMissingError(f"drafter holds no draft probs for step {step_id}")
            ids = self._meta.ids[slot_index][:ids_len].tobytes().decode().split(ID_SEPARATOR) if ids_len else []
            ks_bytes = self._meta.ids[slot_index][ids_len: ids_len + ROW_K_BYTES * b].tobytes()
            drafted_ks = np.frombuffer(ks_bytes, dtype="<i4").tolist()
            rows = self._rows(step_id, ids, request_ids)
            dtype = PROBS_DTYPES[code]
            start = slot_index * int(self._meta.header[HDR_SLOT_BYTES])
            size = b * k * vocab * torch.empty((), dtype=dtype).element_size()
            view = self._buffer[start: start + size].view(dtype).view(b, k, vocab)
            probs = view.to(self.cfg.device, copy=True) if rows is None else view[rows.to(view.device)].to(self.cfg.device)
            _sync(view)  # the drafter's device (a peer copy runs on both) ...
            _sync(probs)  # ... and ours
            if int(words[SLOT_SEQ]) != seq:
                raise DraftProbsMissingError(f"draft step {step_id} was overwritten while it was read")
            check_row_ks(step_id, drafted_ks, list(range(b)) if rows is None else rows.tolist(), num_draft_tokens)
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
