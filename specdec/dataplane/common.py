"""Names shared by the draft-probs data planes (``specdec.dataplane.dist``: torch.distributed,
``specdec.dataplane.ipc``: same-host shared buffers): constants, errors, the dist plane's config."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

DEFAULT_DIST_ADDR = "127.0.0.1"
DEFAULT_DIST_PORT = 29600
DRAFTER_RANK = 0
VERIFIER_RANK = 1
WORLD_SIZE = 2
REQUEST_KEY_PREFIX = "fetch/"
CLOSE_REQUEST = "close"
_IDLE_WAIT = datetime.timedelta(hours=1)  # a fetch request may be long in coming; loop after
STATUS_MISSING = 0
STATUS_FOUND = 1
ID_SEPARATOR = "\0"
_HEADER_LEN = 6
# one op may wait long for the next request (idle service); a dead peer fails the socket sooner
_OP_TIMEOUT = datetime.timedelta(days=7)
_DTYPE_CODES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class DraftProbsMissingError(LookupError):
    """The drafter holds no probs for the requested step (never drafted sampled, or evicted)."""


class DataPlaneUnavailableError(RuntimeError):
    """The dist data plane is not connected (the drafter never joined within the timeout)."""


@dataclass(frozen=True)
class DistPlaneConfig:
    """Address of the dist data plane's TCPStore and buffer bound.

    Raises ValueError naming the field.
    """

    addr: str = DEFAULT_DIST_ADDR
    port: int = DEFAULT_DIST_PORT
    connect_timeout_s: float = 300.0
    max_buffered_steps: int = 8
    device: str = "cpu"  # this end's torch device; NCCL carries the probs when both ends are CUDA

    def __post_init__(self) -> None:
        if not self.addr:
            raise ValueError("addr must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.max_buffered_steps < 1:
            raise ValueError(f"max_buffered_steps must be >= 1, got {self.max_buffered_steps}")


def check_probs(request_ids: list[str], probs: torch.Tensor, dtypes, plane: str,
                num_draft_tokens: list[int] | None = None) -> list[int]:
    """Validate draft probs ``probs`` [b, k, V] of ``request_ids`` (len b) and the rows' k_i
    ``num_draft_tokens`` (None: k for every row) before publishing; returns the k_i.

    Raises:
        ValueError: shape/ids mismatch, a dtype not in ``dtypes`` (named with ``plane``), an
            id containing NUL (``ID_SEPARATOR``), or num_draft_tokens not b values in [0, k].
    """
    if probs.dim() != 3 or probs.shape[0] != len(request_ids):
        raise ValueError(f"probs must be [b={len(request_ids)}, k, V], got {tuple(probs.shape)}")
    k = probs.shape[1]
    ks = [k] * len(request_ids) if num_draft_tokens is None else [int(k_i) for k_i in num_draft_tokens]
    if len(ks) != len(request_ids) or any(not 0 <= k_i <= k for k_i in ks):
        raise ValueError(f"num_draft_tokens must be {len(request_ids)} values in [0, k={k}], got {ks}")
    if probs.dtype not in dtypes:
        raise ValueError(f"probs dtype {probs.dtype} not supported by the {plane} plane")
    if any(ID_SEPARATOR in rid for rid in request_ids):
        raise ValueError("request ids must not contain NUL")
    return ks


def check_row_ks(step_id: int, drafted_ks: list[int], rows: list[int], expected: list[int] | None) -> None:
    """Raise ValueError unless the published k_i of the fetched ``rows`` equal ``expected`` (the
    Verify's ``num_draft_tokens``, in the same order; None: no check): a Verify that describes
    its ragged rows differently from the Draft that made them would read padding as drafts."""
    if expected is None:
        return
    published = [drafted_ks[row] for row in rows]
    if published != [int(k_i) for k_i in expected]:
        raise ValueError(f"num_draft_tokens {list(expected)} differ from the {published} drafted at step {step_id}")
