"""Draft-probability data plane between drafter_svc and verifier_svc rank 0.

Why: lossless rejection sampling (Leviathan et al. 2023, Alg. 1; MineDraft paper §5) needs
the full draft distribution q [b, k, V] at the verifier; at V = 49152 to 151936 that is MBs
per step, which should not ride through the coordinator in protobuf on a GPU deployment
(DESIGN.md §4). Draft token ids always travel inline in gRPC (tiny); at temperature 0 the
drafter produces no probs and nothing but ids travels.

Planes (``--data-plane``):
- ``inline``: probs are ``DraftResponse.draft_probs`` -> coordinator -> ``VerifyRequest.draft_probs``
  (``specdec.tensor_proto``); nothing in this module is used.
- ``dist``: torch.distributed point-to-point in a 2-rank gloo group of its own (a
  ``ProcessGroupGloo`` over a ``TCPStore`` on ``addr:port``, default 127.0.0.1:29600), separate
  from the verifier's tensor-parallel world. Rank 0 = drafter (hosts the store), rank 1 =
  verifier rank 0.

Protocol of the dist plane ("send only on demand", so a send can never be left unreceived):
1. Draft(step_id) on the drafter: ``DraftProbsServer.publish(step_id, request_ids, probs)``
   keeps (request ids, probs) in a bounded FIFO buffer (``max_buffered_steps``; the oldest
   step is dropped when full). Nothing is sent.
2. Verify(data_plane=DIST, draft_step_id) on verifier rank 0: ``DraftProbsClient.fetch``
   sends the request ``int64[2] = [OP_FETCH, draft_step_id]`` and receives
   ``int64[6] = [status, num_id_bytes, dtype_code, b, k, V]``; if status is FOUND it then
   receives the request ids (utf-8, NUL-separated, uint8[num_id_bytes]) and the probs as raw
   bytes uint8[b*k*V*itemsize] in their exact dtype. The entry is removed from the buffer.
   The verifier keeps the rows of the request ids it verifies (a request aborted between draft
   and verify is simply not asked for) and broadcasts them in its TP group.
3. A step whose verify never comes (abort, fallback) is never sent: it ages out of the buffer.
   Every send has a receiver already blocked in recv, so neither side can deadlock on an
   unmatched send. Only one fetch is in flight at a time (one verifier engine thread).
4. ``DraftProbsClient.close`` sends ``[OP_CLOSE, 0]``; the drafter's serving thread exits.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_DIST_ADDR = "127.0.0.1"
DEFAULT_DIST_PORT = 29600
DRAFTER_RANK = 0
VERIFIER_RANK = 1
WORLD_SIZE = 2
OP_FETCH = 1
OP_CLOSE = 2
STATUS_MISSING = 0
STATUS_FOUND = 1
ID_SEPARATOR = "\0"
_HEADER_LEN = 6
# one op may wait long for the next request (idle service); a dead peer fails the socket sooner
_OP_TIMEOUT = datetime.timedelta(days=7)
_DTYPE_CODES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class DraftProbsMissingError(LookupError):
    """The drafter holds no probs for the requested step (never drafted sampled, or evicted)."""


@dataclass(frozen=True)
class DistPlaneConfig:
    """Address of the dist data plane's TCPStore and buffer bound.

    Raises ValueError naming the field.
    """

    addr: str = DEFAULT_DIST_ADDR
    port: int = DEFAULT_DIST_PORT
    connect_timeout_s: float = 300.0
    max_buffered_steps: int = 8

    def __post_init__(self) -> None:
        if not self.addr:
            raise ValueError("addr must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.max_buffered_steps < 1:
            raise ValueError(f"max_buffered_steps must be >= 1, got {self.max_buffered_steps}")


def _connect(cfg: DistPlaneConfig, rank: int) -> dist.ProcessGroupGloo:
    """Rendezvous of the 2-rank group; blocks until both ranks joined (or connect timeout)."""
    store = dist.TCPStore(
        cfg.addr, cfg.port, WORLD_SIZE, rank == DRAFTER_RANK,
        timeout=datetime.timedelta(seconds=cfg.connect_timeout_s),
    )
    return dist.ProcessGroupGloo(store, rank, WORLD_SIZE, _OP_TIMEOUT)


def _send(group: dist.ProcessGroupGloo, tensor: torch.Tensor, peer: int) -> None:
    group.send([tensor], peer, 0).wait()


def _recv(group: dist.ProcessGroupGloo, tensor: torch.Tensor, peer: int) -> torch.Tensor:
    group.recv([tensor], peer, 0).wait()
    return tensor


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


class DraftProbsServer:
    """Drafter side: buffers draft probs per step and sends them when the verifier asks."""

    def __init__(self, cfg: DistPlaneConfig) -> None:
        self.cfg = cfg
        self._buffer: collections.OrderedDict[int, tuple[tuple[str, ...], torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="draft-probs-server", daemon=True)
        self.is_connected = threading.Event()
        self.num_evicted = 0

    def start(self) -> None:
        """Connect and serve in a daemon thread (does not wait for the verifier)."""
        self._thread.start()

    def publish(self, step_id: int, request_ids: list[str], probs: torch.Tensor) -> None:
        """Keep ``probs`` [b, k, V] of ``request_ids`` (len b) for step ``step_id`` until fetched.

        Raises:
            ValueError: shape/ids mismatch, unsupported dtype, or an id containing NUL.
        """
        if probs.dim() != 3 or probs.shape[0] != len(request_ids):
            raise ValueError(f"probs must be [b={len(request_ids)}, k, V], got {tuple(probs.shape)}")
        if probs.dtype not in _DTYPE_CODES:
            raise ValueError(f"probs dtype {probs.dtype} not supported by the dist plane")
        if any(ID_SEPARATOR in rid for rid in request_ids):
            raise ValueError("request ids must not contain NUL")
        with self._lock:
            self._buffer[step_id] = (tuple(request_ids), probs.detach().to("cpu").contiguous())
            while len(self._buffer) > self.cfg.max_buffered_steps:
                self._buffer.popitem(last=False)
                self.num_evicted += 1

    def _take(self, step_id: int) -> tuple[tuple[str, ...], torch.Tensor] | None:
        with self._lock:
            return self._buffer.pop(step_id, None)

    def _serve(self) -> None:
        try:
            group = _connect(self.cfg, DRAFTER_RANK)
            self.is_connected.set()
            request = torch.zeros(2, dtype=torch.int64)
            while True:
                op, step_id = _recv(group, request, VERIFIER_RANK).tolist()
                if op == OP_CLOSE:
                    return
                self._answer(group, self._take(step_id))
        except Exception:
            logger.exception("draft-probs server stopped")

    def _answer(self, group: dist.ProcessGroupGloo, entry) -> None:
        if entry is None:
            _send(group, torch.tensor([STATUS_MISSING, 0, 0, 0, 0, 0], dtype=torch.int64), VERIFIER_RANK)
            return
        request_ids, probs = entry
        id_bytes = torch.frombuffer(bytearray(ID_SEPARATOR.join(request_ids).encode()), dtype=torch.uint8)
        b, k, vocab = probs.shape
        header = [STATUS_FOUND, id_bytes.numel(), _DTYPE_CODES.index(probs.dtype), b, k, vocab]
        _send(group, torch.tensor(header, dtype=torch.int64), VERIFIER_RANK)
        if id_bytes.numel():
            _send(group, id_bytes, VERIFIER_RANK)
        if probs.numel():
            _send(group, _as_bytes(probs), VERIFIER_RANK)


class DraftProbsClient:
    """Verifier rank 0 side: fetches a drafted step's probs on demand (see module protocol)."""

    def __init__(self, cfg: DistPlaneConfig) -> None:
        self.cfg = cfg
        self._group: dist.ProcessGroupGloo | None = None
        self._lock = threading.Lock()

    def connect(self) -> None:
        """Join the group (blocks until the drafter joined; TimeoutError-like RuntimeError after
        ``connect_timeout_s``)."""
        if self._group is None:
            self._group = _connect(self.cfg, VERIFIER_RANK)

    @property
    def is_connected(self) -> bool:
        return self._group is not None

    def fetch(self, step_id: int, request_ids: list[str]) -> torch.Tensor:
        """Draft probs [len(request_ids), k, V] (the drafter's dtype) of ``step_id``, rows in
        ``request_ids`` order.

        Raises:
            RuntimeError: not connected.
            DraftProbsMissingError: the drafter has no probs for the step, or lacks a request id.
        """
        if self._group is None:
            raise RuntimeError("dist data plane is not connected")
        with self._lock:
            drafted_ids, probs = self._fetch_all(self._group, step_id)
        row_of = {rid: row for row, rid in enumerate(drafted_ids)}
        missing = [rid for rid in request_ids if rid not in row_of]
        if missing:
            raise DraftProbsMissingError(f"draft step {step_id} has no probs for request ids {missing}")
        rows = [row_of[rid] for rid in request_ids]
        if rows == list(range(len(drafted_ids))):
            return probs
        return probs[torch.tensor(rows, dtype=torch.long)]

    def _fetch_all(self, group, step_id: int) -> tuple[list[str], torch.Tensor]:
        _send(group, torch.tensor([OP_FETCH, step_id], dtype=torch.int64), DRAFTER_RANK)
        header = _recv(group, torch.zeros(_HEADER_LEN, dtype=torch.int64), DRAFTER_RANK).tolist()
        status, num_id_bytes, dtype_code, b, k, vocab = header
        if status != STATUS_FOUND:
            raise DraftProbsMissingError(f"drafter holds no draft probs for step {step_id}")
        id_bytes = torch.empty(num_id_bytes, dtype=torch.uint8)
        if num_id_bytes:
            _recv(group, id_bytes, DRAFTER_RANK)
        dtype = _DTYPE_CODES[dtype_code]
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(b * k * vocab * itemsize, dtype=torch.uint8)
        if raw.numel():
            _recv(group, raw, DRAFTER_RANK)
        drafted_ids = id_bytes.numpy().tobytes().decode().split(ID_SEPARATOR) if num_id_bytes else []
        return drafted_ids, raw.view(dtype).reshape(b, k, vocab)

    def close(self) -> None:
        """Tell the drafter's serving thread to exit; idempotent."""
        if self._group is not None:
            with self._lock:
                _send(self._group, torch.tensor([OP_CLOSE, 0], dtype=torch.int64), DRAFTER_RANK)
            self._group = None
