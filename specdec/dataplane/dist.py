"""Draft-probability data plane between drafter_svc and verifier_svc rank 0.

Why: lossless rejection sampling (Leviathan et al. 2023, Alg. 1; MineDraft paper §5) needs
the full draft distribution q [b, k, V] at the verifier; at V = 49152 to 151936 that is MBs
per step, which should not ride through the coordinator in protobuf on a GPU deployment
(DESIGN.md §4). Draft token ids always travel inline in gRPC (tiny); at temperature 0 the
drafter produces no probs and nothing but ids travels.

Planes (``--data-plane``):
- ``inline``: probs are ``DraftResponse.draft_probs`` -> coordinator -> ``VerifyRequest.draft_probs``
  (``engine_svc.tensor_proto``); nothing in this module is used.
- ``dist``: torch.distributed point-to-point in a 2-rank group of its own (``TCPStore`` on
  ``addr:port``, default 127.0.0.1:29600), separate from the verifier's tensor-parallel world.
  Rank 0 = drafter (hosts the store), rank 1 = verifier rank 0. Control messages use gloo;
  the probs use NCCL GPU to GPU in their exact dtype when both ends are CUDA
  (``specdec.dataplane.nccl``), else gloo as raw CPU bytes (the CPU twin).
- ``ipc``: shared buffers on one host (CUDA IPC / /dev/shm), ``specdec.dataplane.ipc``.

Protocol of the dist plane ("send only on demand", so a send can never be left unreceived):
1. Draft(step_id) on the drafter: ``DraftProbsServer.publish(step_id, request_ids, probs)``
   keeps (request ids, probs) in a bounded FIFO buffer (``max_buffered_steps``; the oldest
   step is dropped when full). Nothing is sent.
2. Verify(data_plane=DIST, draft_step_id) on verifier rank 0: ``DraftProbsClient.fetch`` posts
   the request as TCPStore key ``fetch/<n>`` = ``draft_step_id`` (n counts requests), then
   receives over the gloo group ``int64[6] = [status, num_id_bytes, dtype_code, b, k, V]``;
   if status is FOUND it then receives the request ids (utf-8, NUL-separated,
   uint8[num_id_bytes]), each row's number of draft tokens k_i (``int64[b]``; ragged rows:
   probs past k_i are zero padding; the verifier checks them against its Verify) and the probs: NCCL ``dtype[b, k, V]`` on its device, or gloo raw
   bytes uint8[b*k*V*itemsize], exact dtype either way. The drafter's serving thread waits on the store key, answers, and removes the
   entry from the buffer. The verifier keeps the rows of the
   request ids it verifies (a request aborted between draft and verify is simply not asked
   for) and broadcasts them in its TP group.
3. A step whose verify never comes (abort, fallback) is never sent: it ages out of the buffer.
   Every send answers a request whose sender is already blocked in recv, and no recv is ever
   left posted while idle, so neither side can deadlock on an unmatched send, and either side
   can shut down at any time between fetches. Only one fetch is in flight at a time.
4. ``DraftProbsClient.close`` posts ``fetch/<n>`` = ``close``; ``DraftProbsServer.stop`` posts
   the same through a store connection of its own, so the serving thread ends either way.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading

import torch
import torch.distributed as dist

from specdec.dataplane import nccl

logger = logging.getLogger(__name__)

from specdec.dataplane.common import (  # noqa: F401 (re-exported: the plane's public names)
    DEFAULT_DIST_ADDR, DEFAULT_DIST_PORT, DRAFTER_RANK, VERIFIER_RANK, WORLD_SIZE, REQUEST_KEY_PREFIX,
    CLOSE_REQUEST, _IDLE_WAIT, STATUS_MISSING, STATUS_FOUND, ID_SEPARATOR, check_probs, check_row_ks,
    _HEADER_LEN, _OP_TIMEOUT, _DTYPE_CODES, DraftProbsMissingError, DataPlaneUnavailableError, DistPlaneConfig,
)


def _connect(cfg: DistPlaneConfig, rank: int):
    """Rendezvous of the 2-rank group; blocks until both ranks joined (or connect timeout).
    Returns (store, gloo group, NCCL bulk group or None)."""
    store = dist.TCPStore(
        cfg.addr, cfg.port, WORLD_SIZE, rank == DRAFTER_RANK,
        timeout=datetime.timedelta(seconds=cfg.connect_timeout_s),
    )
    # the group gets its own key space, so our request keys never clash with its rendezvous
    group = dist.ProcessGroupGloo(dist.PrefixStore("group/", store), rank, WORLD_SIZE, _OP_TIMEOUT)
    peer_type = nccl.post_device_and_read_peer(store, rank, WORLD_SIZE - 1 - rank, cfg.device, cfg.connect_timeout_s)
    return store, group, nccl.make_bulk_group(store, rank, WORLD_SIZE, cfg.device, peer_type)


def _send(group: dist.ProcessGroupGloo, tensor: torch.Tensor, peer: int) -> None:
    group.send([tensor], peer, 0).wait()


def _recv(group: dist.ProcessGroupGloo, tensor: torch.Tensor, peer: int) -> torch.Tensor:
    group.recv([tensor], peer, 0).wait()
    return tensor


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _wait_request(store: dist.TCPStore, index: int) -> bool:
    """Wait for the ``index``-th fetch request; False after a long idle wait."""
    try:
        store.wait([f"{REQUEST_KEY_PREFIX}{index}"], _IDLE_WAIT)
    except dist.DistStoreError:
        return False
    return True


class DraftProbsServer:
    """Drafter side: buffers draft probs per step and sends them when the verifier asks."""

    def __init__(self, cfg: DistPlaneConfig) -> None:
        self.cfg = cfg
        self._buffer: collections.OrderedDict[int, tuple[tuple[str, ...], torch.Tensor, list[int]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="draft-probs-server", daemon=True)
        self._stop = threading.Event()
        self.is_connected = threading.Event()
        self.num_evicted = 0
        self._num_requests = 0
        self._bulk = None  # NCCL group when both ends are CUDA

    def start(self) -> None:
        """Connect and serve in a daemon thread (does not wait for the verifier)."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving fetches: wake the serving thread with a close request, then join it."""
        self._stop.set()
        if not self._thread.is_alive():
            return
        with self._lock:  # the serving thread cannot end (and close the store) meanwhile
            if self.is_connected.is_set():
                self._post_close(timeout_s)
        self._thread.join(timeout_s)

    def _post_close(self, timeout_s: float) -> None:
        try:
            own = dist.TCPStore(self.cfg.addr, self.cfg.port, WORLD_SIZE, False,
                                timeout=datetime.timedelta(seconds=timeout_s))
            own.set(f"{REQUEST_KEY_PREFIX}{self._num_requests}", CLOSE_REQUEST)
        except Exception as exc:
            logger.warning("dist data plane: cannot wake the serving thread (%s)", exc)

    def publish(self, step_id: int, request_ids: list[str], probs: torch.Tensor,
                num_draft_tokens: list[int] | None = None) -> None:
        """Keep ``probs`` [b, k, V] of ``request_ids`` (len b) and their rows' k_i
        ``num_draft_tokens`` (b values in [0, k]; None: k for all) for step ``step_id`` until fetched.

        Raises:
            ValueError: shape/ids/k_i mismatch, unsupported dtype, or an id containing NUL.
        """
        ks = check_probs(request_ids, probs, _DTYPE_CODES, "dist", num_draft_tokens)
        with self._lock:
            kept = probs.detach() if probs.is_cuda else probs.detach().to("cpu")  # NCCL sends from the GPU
            self._buffer[step_id] = (tuple(request_ids), kept.contiguous(), ks)
            while len(self._buffer) > self.cfg.max_buffered_steps:
                self._buffer.popitem(last=False)
                self.num_evicted += 1

    def _take(self, step_id: int) -> tuple[tuple[str, ...], torch.Tensor, list[int]] | None:
        with self._lock:
            return self._buffer.pop(step_id, None)

    def _serve(self) -> None:
        try:
            store, group, self._bulk = _connect(self.cfg, DRAFTER_RANK)
            self.is_connected.set()
            while not self._stop.is_set():
                if not _wait_request(store, self._num_requests):
                    continue
                with self._lock:  # ``stop`` posts at ``_num_requests`` under the same lock
                    key = f"{REQUEST_KEY_PREFIX}{self._num_requests}"
                    request = store.get(key).decode()
                    store.delete_key(key)
                    self._num_requests += 1
                    if request == CLOSE_REQUEST:
                        self.is_connected.clear()
                        return
                self._answer(group, self._take(int(request)))
        except Exception:
            if not self._stop.is_set():
                logger.exception("draft-probs server stopped")

    def _answer(self, group: dist.ProcessGroupGloo, entry) -> None:
        if entry is None:
            _send(group, torch.tensor([STATUS_MISSING, 0, 0, 0, 0, 0], dtype=torch.int64), VERIFIER_RANK)
            return
        request_ids, probs, ks = entry
        id_bytes = torch.frombuffer(bytearray(ID_SEPARATOR.join(request_ids).encode()), dtype=torch.uint8)
        b, k, vocab = probs.shape
        header = [STATUS_FOUND, id_bytes.numel(), _DTYPE_CODES.index(probs.dtype), b, k, vocab]
        _send(group, torch.tensor(header, dtype=torch.int64), VERIFIER_RANK)
        if id_bytes.numel():
            _send(group, id_bytes, VERIFIER_RANK)
        if b:
            _send(group, torch.tensor(ks, dtype=torch.int64), VERIFIER_RANK)
        if probs.numel() and self._bulk is not None:
            nccl.send_probs(self._bulk, probs, VERIFIER_RANK, self.cfg.device)
        elif probs.numel():
            _send(group, _as_bytes(probs), VERIFIER_RANK)


class DraftProbsClient:
    """Verifier rank 0 side: fetches a drafted step's probs on demand (see module protocol)."""

    def __init__(self, cfg: DistPlaneConfig) -> None:
        self.cfg = cfg
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None
        self._bulk = None  # NCCL group when both ends are CUDA
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._num_requests = 0

    def connect(self) -> None:
        """Join the group; blocks until the drafter joined (RuntimeError after
        ``connect_timeout_s``)."""
        if self._group is None:
            self._store, self._group, self._bulk = _connect(self.cfg, VERIFIER_RANK)
            self._connected.set()

    def _post(self, request: str) -> None:
        self._store.set(f"{REQUEST_KEY_PREFIX}{self._num_requests}", request)
        self._num_requests += 1

    def start_connect(self) -> None:
        """``connect`` in a daemon thread; ``fetch`` waits for it (see ``fetch``)."""
        def run() -> None:
            try:
                self.connect()
            except Exception:
                logger.exception("dist data plane: cannot connect to the drafter at %s:%d",
                                 self.cfg.addr, self.cfg.port)
        threading.Thread(target=run, name="draft-probs-connect", daemon=True).start()

    @property
    def is_connected(self) -> bool:
        return self._group is not None

    def fetch(self, step_id: int, request_ids: list[str], num_draft_tokens: list[int] | None = None) -> torch.Tensor:
        """Draft probs [len(request_ids), k, V] (the drafter's dtype) of ``step_id``, rows in
        ``request_ids`` order; ``num_draft_tokens``: the k_i the caller expects of those rows
        (None: not checked).

        Waits up to ``connect_timeout_s`` for a connection started by ``start_connect``.

        Raises:
            DataPlaneUnavailableError: not connected.
            DraftProbsMissingError: the drafter has no probs for the step, or lacks a request id.
            ValueError: a fetched row was drafted with another k_i than ``num_draft_tokens`` says.
        """
        if not self._connected.wait(self.cfg.connect_timeout_s) or self._group is None:
            raise DataPlaneUnavailableError(
                f"dist data plane to the drafter at {self.cfg.addr}:{self.cfg.port} is not connected")
        with self._lock:
            drafted_ids, drafted_ks, probs = self._fetch_all(self._group, step_id)
        row_of = {rid: row for row, rid in enumerate(drafted_ids)}
        missing = [rid for rid in request_ids if rid not in row_of]
        if missing:
            raise DraftProbsMissingError(f"draft step {step_id} has no probs for request ids {missing}")
        rows = [row_of[rid] for rid in request_ids]
        check_row_ks(step_id, drafted_ks, rows, num_draft_tokens)
        if rows == list(range(len(drafted_ids))):
            return probs
        return probs[torch.tensor(rows, dtype=torch.long, device=probs.device)]

    def _fetch_all(self, group, step_id: int) -> tuple[list[str], list[int], torch.Tensor]:
        self._post(str(int(step_id)))
        header = _recv(group, torch.zeros(_HEADER_LEN, dtype=torch.int64), DRAFTER_RANK).tolist()
        status, num_id_bytes, dtype_code, b, k, vocab = header
        if status != STATUS_FOUND:
            raise DraftProbsMissingError(f"drafter holds no draft probs for step {step_id}")
        id_bytes = torch.empty(num_id_bytes, dtype=torch.uint8)
        if num_id_bytes:
            _recv(group, id_bytes, DRAFTER_RANK)
        dtype = _DTYPE_CODES[dtype_code]
        drafted_ids = id_bytes.numpy().tobytes().decode().split(ID_SEPARATOR) if num_id_bytes else []
        drafted_ks = _recv(group, torch.zeros(b, dtype=torch.int64), DRAFTER_RANK).tolist() if b else []
        if self._bulk is not None and b * k * vocab:
            return drafted_ids, drafted_ks, nccl.recv_probs(self._bulk, (b, k, vocab), dtype, DRAFTER_RANK, self.cfg.device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(b * k * vocab * itemsize, dtype=torch.uint8)
        if raw.numel():
            _recv(group, raw, DRAFTER_RANK)
        return drafted_ids, drafted_ks, raw.view(dtype).reshape(b, k, vocab)

    def close(self) -> None:
        """Tell the drafter's serving thread to exit (best effort: the drafter may be gone)."""
        if self._group is None:
            return
        with self._lock:
            try:
                self._post(CLOSE_REQUEST)
            except Exception as exc:  # the drafter (store host) already stopped
                logger.info("dist data plane: close not delivered (%s)", exc)
            self._store = self._group = self._bulk = None
            self._connected.clear()
