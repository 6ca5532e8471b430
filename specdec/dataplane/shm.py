"""Buffers shared between two processes of one host: CUDA IPC on a GPU, a /dev/shm file on CPU.

Used by ``specdec.dataplane.ipc``: the drafter allocates a flat uint8 buffer once and exports
a descriptor (bytes, never pickled); the verifier imports it and sees the same memory.

- CUDA: the buffer's storage is shared with ``UntypedStorage._share_cuda_()`` (cudaIpcGetMemHandle
  under the hood; the same path ``torch.multiprocessing`` takes) and opened with
  ``UntypedStorage._new_shared_cuda``. Descriptor: ``KIND_CUDA`` + the eight fields of
  ``_share_cuda_`` (device, handle, size, offset, ref-counter handle/offset, event handle,
  event-sync flag) as length-prefixed little-endian fields.
- CPU (the twin CI runs): a file under ``/dev/shm`` mapped with ``torch.from_file(shared=True)``
  in both processes. Descriptor: ``KIND_FILE`` + size + the file's path.
"""

from __future__ import annotations

import os
import struct

import torch

KIND_FILE = 1
KIND_CUDA = 2
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
_INT = struct.Struct("<q")
_LEN = struct.Struct("<I")


class DescriptorError(ValueError):
    """A shared-buffer descriptor that cannot be parsed."""


def _pack(fields: list[int | bytes]) -> bytes:
    out = bytearray()
    for value in fields:
        if isinstance(value, bytes):
            out += b"b" + _LEN.pack(len(value)) + value
        else:
            out += b"i" + _INT.pack(int(value))
    return bytes(out)


def _unpack(data: bytes) -> list[int | bytes]:
    fields, pos = [], 0
    try:
        while pos < len(data):
            tag, pos = data[pos:pos + 1], pos + 1
            if tag == b"i":
                fields.append(_INT.unpack_from(data, pos)[0])
                pos += _INT.size
            elif tag == b"b":
                (length,), pos = _LEN.unpack_from(data, pos), pos + _LEN.size
                fields.append(bytes(data[pos:pos + length]))
                pos += length
            else:
                raise DescriptorError(f"bad field tag {tag!r} at byte {pos - 1}")
    except struct.error as exc:
        raise DescriptorError(f"truncated descriptor: {exc}") from exc
    return fields


def create_file_buffer(path: str, num_bytes: int) -> torch.Tensor:
    """A uint8 [num_bytes] CPU tensor backed by a new file that atomically replaces ``path``
    (a new inode: a process still mapping an older file at ``path`` keeps valid memory)."""
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "wb") as handle:
        handle.truncate(max(num_bytes, 1))
    buffer = torch.from_file(temp, shared=True, size=num_bytes, dtype=torch.uint8)
    os.replace(temp, path)
    return buffer


def allocate(num_bytes: int, device: str | torch.device, file_path: str) -> torch.Tensor:
    """A shareable flat uint8 [num_bytes] buffer on ``device`` (``file_path`` backs a CPU one)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    if device.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {device}")
    return create_file_buffer(file_path, num_bytes)


def export(buffer: torch.Tensor) -> bytes:
    """Descriptor of a buffer from ``allocate`` (CPU buffers: of the file they were created on).

    Raises:
        ValueError: a CPU buffer not backed by a file (pass ``file_path`` to ``export_file``).
    """
    if buffer.device.type != "cuda":
        raise ValueError("CPU buffers are exported with export_file(path, num_bytes)")
    storage = buffer.untyped_storage()
    device, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync = storage._share_cuda_()
    return _pack([KIND_CUDA, device, handle, size, offset, rc_handle or b"", rc_offset,
                  event_handle or b"", int(bool(event_sync)), buffer.numel()])


def export_file(path: str, num_bytes: int) -> bytes:
    """Descriptor of a file-backed CPU buffer."""
    return _pack([KIND_FILE, num_bytes, path.encode()])


def open_shared(descriptor: bytes) -> torch.Tensor:
    """The uint8 buffer a descriptor names, mapped into this process (no copy).

    Raises:
        DescriptorError: unknown kind or malformed fields; FileNotFoundError: the file is gone.
    """
    fields = _unpack(descriptor)
    if not fields:
        raise DescriptorError("empty descriptor")
    if fields[0] == KIND_FILE and len(fields) == 3:
        num_bytes, path = fields[1], fields[2].decode()
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        return torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    if fields[0] == KIND_CUDA and len(fields) == 10:
        _, device, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync, num_bytes = fields
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            device, handle, size, offset, rc_handle or None, rc_offset, event_handle or None, bool(event_sync))
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        return torch._utils._rebuild_tensor(typed, 0, (num_bytes,), (1,))  # as torch.multiprocessing does
    raise DescriptorError(f"unknown descriptor kind {fields[0]} with {len(fields)} fields")
