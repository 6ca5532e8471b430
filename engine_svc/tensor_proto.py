"""torch.Tensor <-> ``minedraft.v1.Tensor`` (raw little-endian bytes, row-major; never pickled).

Wire format (protos/minedraft/v1/common.proto, message Tensor): ``shape`` (int64 dims),
``dtype`` (one of ``SUPPORTED_DTYPES``) and ``data`` = the contiguous little-endian bytes.
bfloat16 has no numpy dtype, so its bytes are moved through a view as int16 (same width,
bit-identical). Decoding checks that the byte count matches shape x element size.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from minedraft.v1 import common_pb2

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}
# dtypes without a numpy twin travel as a same-width integer view
_BIT_VIEW = {torch.bfloat16: torch.int16}
_IS_LITTLE_ENDIAN = sys.byteorder == "little"


class TensorDecodeError(ValueError):
    """A ``minedraft.v1.Tensor`` whose dtype, shape or byte count is invalid."""


def _to_le_bytes(array: np.ndarray) -> bytes:
    if not _IS_LITTLE_ENDIAN:
        array = array.byteswap()
    return array.tobytes(order="C")


def tensor_to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Encode a CPU or device tensor (copied to CPU) as ``minedraft.v1.Tensor``.

    Raises:
        ValueError: the dtype is not one of ``SUPPORTED_DTYPES``.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"dtype {tensor.dtype} is not supported on the wire; use one of {sorted(SUPPORTED_DTYPES)}")
    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.dtype in _BIT_VIEW:
        cpu = cpu.view(_BIT_VIEW[cpu.dtype])
    return common_pb2.Tensor(shape=list(tensor.shape), dtype=name, data=_to_le_bytes(cpu.numpy()))


def proto_to_tensor(message: common_pb2.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """Decode ``minedraft.v1.Tensor`` into a tensor on ``device`` (a fresh, writable copy).

    Raises:
        TensorDecodeError: unknown dtype, negative dims, or byte count != prod(shape) * itemsize.
    """
    dtype = SUPPORTED_DTYPES.get(message.dtype)
    if dtype is None:
        raise TensorDecodeError(f"unknown tensor dtype {message.dtype!r}; expected one of {sorted(SUPPORTED_DTYPES)}")
    shape = tuple(int(dim) for dim in message.shape)
    if any(dim < 0 for dim in shape):
        raise TensorDecodeError(f"tensor shape {shape} has a negative dimension")
    wire_dtype = _BIT_VIEW.get(dtype, dtype)
    itemsize = torch.empty((), dtype=wire_dtype).element_size()
    num_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(message.data) != num_elements * itemsize:
        raise TensorDecodeError(
            f"tensor data has {len(message.data)} bytes; shape {shape} x {message.dtype} needs {num_elements * itemsize}"
        )
    np_dtype = torch.empty((), dtype=wire_dtype).numpy().dtype.newbyteorder("<")
    array = np.frombuffer(message.data, dtype=np_dtype).astype(np_dtype.newbyteorder("="), copy=True)
    tensor = torch.from_numpy(array).reshape(shape)
    if wire_dtype is not dtype:
        tensor = tensor.view(dtype)
    return tensor.to(device)


def is_empty_proto(message: common_pb2.Tensor) -> bool:
    """True for an unset/default ``Tensor`` field (no dtype, no shape)."""
    return not message.dtype and not message.shape
