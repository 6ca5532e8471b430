"""The dist plane's bulk channel: NCCL between two GPUs, else the gloo control group itself.

``specdec.dataplane.dist`` always keeps a gloo group for the small control messages (header,
request ids). At connect each rank posts its device type under ``device/<rank>`` in the
plane's TCPStore; when both ends are CUDA a second group, ``ProcessGroupNCCL`` over the same
store (key prefix ``nccl/``), carries the draft probs GPU to GPU in their exact dtype (NVLink
or PCIe, no host copy). Otherwise the probs travel through gloo as raw CPU bytes.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

DEVICE_KEY_PREFIX = "device/"
CUDA = "cuda"


def post_device_and_read_peer(store: dist.TCPStore, rank: int, peer: int, device: str,
                              timeout_s: float) -> str:
    """Post this rank's device type, wait for the peer's; returns the peer's (``cuda``/``cpu``)."""
    store.set(f"{DEVICE_KEY_PREFIX}{rank}", torch.device(device).type)
    key = f"{DEVICE_KEY_PREFIX}{peer}"
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return store.get(key).decode()


def make_bulk_group(store: dist.TCPStore, rank: int, world_size: int, device: str, peer_device_type: str):
    """``ProcessGroupNCCL`` when this rank's ``device`` and the peer are CUDA, else None (use gloo).

    Raises:
        RuntimeError: both ends are CUDA but this torch has no NCCL.
    """
    if torch.device(device).type != CUDA or peer_device_type != CUDA:
        return None
    if not dist.is_nccl_available():
        raise RuntimeError("both data-plane ends are CUDA but torch.distributed has no NCCL")
    torch.cuda.set_device(torch.device(device))
    options = dist.ProcessGroupNCCL.Options()
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, options)


def send_probs(group, probs: torch.Tensor, peer: int, device: str) -> None:
    """NCCL send of ``probs`` (moved to ``device`` if it lives elsewhere), exact dtype."""
    tensor = probs.to(device, non_blocking=True).contiguous()
    torch.cuda.set_device(tensor.device)  # the serving thread's current device for NCCL
    group.send([tensor], peer, 0).wait()


def recv_probs(group, shape: tuple[int, int, int], dtype: torch.dtype, peer: int, device: str) -> torch.Tensor:
    """NCCL receive of probs ``shape`` in ``dtype`` into a new tensor on ``device``; the current
    stream waits for it (no host sync)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    group.recv([tensor], peer, 0).wait()
    return tensor
