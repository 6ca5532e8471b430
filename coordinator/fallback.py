"""Drafter availability: ``ar`` fallback when the drafter fails, periodic probe and re-sync.

While the drafter is unavailable every request continues on the verifier alone (a verify step
with k = 0 is plain decoding, so outputs stay exactly the target model's). Every
``retry_s`` seconds :meth:`DrafterLink.probe` asks the drafter for ``GetInfo``; when it answers,
the running requests are released there (it may still hold stale state) and re-added with their
committed sequence minus the last token as the prompt, so the next Draft call feeds that token
(``DraftSeq.start_position = len(committed) - 1``), exactly like a freshly admitted request.

A drafter that refuses a request (RESOURCE_EXHAUSTED or INVALID_ARGUMENT for one prompt; any other
error loses it; ``EngineClients.add_to_drafter``) is not lost: only that request runs undrafted
(k = 0) until it finishes (``DrafterLink.refused``), the others keep speculating.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import grpc

from minedraft.v1 import engine_pb2

from coordinator.engines import EngineClients
from coordinator.request import RequestState

logger = logging.getLogger(__name__)


async def add_committed(engines: EngineClients, requests: list[RequestState]) -> dict[str, grpc.aio.AioRpcError]:
    """Add ``requests`` to the drafter with their committed tokens but the last as the prompt, so
    the next Draft call feeds that token (module docstring); marks those it took as told and
    returns the refused ones (``EngineClients.add_to_drafter``). Raises grpc.aio.AioRpcError on
    a transport error."""
    if not requests:
        return {}
    seqs = [engine_pb2.SeqInit(request_id=r.request_id, prompt_token_ids=r.committed[:-1], sampling=r.sampling)
            for r in requests]
    refused = await engines.add_to_drafter(seqs)
    for request in requests:
        if request.request_id not in refused:
            request.num_drafter_tokens = len(request.committed) - 1
    return refused


IDLE_CHECK_S = 5.0  # while idle, an available drafter is asked for GetInfo this often (s)


class DrafterLink:
    """Whether the drafter is usable, when to probe it next, and what it must forget on return.
    While the coordinator is idle an available drafter is checked every ``idle_check_s`` seconds
    too, so one that died between requests reads as unavailable (``drafter_available`` 0)."""

    def __init__(self, is_used: bool, retry_s: float, idle_check_s: float = IDLE_CHECK_S) -> None:
        self.is_used = is_used
        self.is_available = is_used
        self.retry_s, self.idle_check_s = retry_s, idle_check_s
        self._next_probe = self._next_check = 0.0
        self._num_failed_probes = 0
        self._orphans: set[str] = set()  # released while it was away: release there on return
        self.refused: set[str] = set()  # ids the drafter refused: undrafted until released

    @property
    def is_due(self) -> bool:
        """The drafter is used, unavailable, and the next probe time has come."""
        return self.is_used and not self.is_available and time.monotonic() >= self._next_probe

    @property
    def probe_wait_s(self) -> float | None:
        """Seconds until the next probe or idle check is due (0 when due), or None when the
        drafter is not used: how long the idle loop may sleep."""
        if not self.is_used:
            return None
        return max((self._next_check if self.is_available else self._next_probe) - time.monotonic(), 0.0)

    async def check_idle(self, engines: EngineClients) -> grpc.aio.AioRpcError | None:
        """While idle: GetInfo to an available drafter once ``idle_check_s`` has passed; returns
        the error if it does not answer (the caller loses the drafter), else None."""
        if not (self.is_used and self.is_available) or time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + self.idle_check_s
        try:
            await _ping(engines, min(engines.timeout, self.retry_s))
        except grpc.aio.AioRpcError as exc:
            return exc
        return None

    def note_released(self, request_ids: Iterable[str]) -> None:
        """Forget the refusals of released ids; remember ids released while the drafter is away
        (released there once it is back)."""
        request_ids = set(request_ids)
        self.refused -= request_ids
        if self.is_used and not self.is_available:
            self._orphans.update(request_ids)

    def refuse(self, refused: dict[str, grpc.aio.AioRpcError]) -> None:
        """Run the requests the drafter refused undrafted from now on (module docstring)."""
        for request_id, exc in refused.items():
            logger.warning("drafter refused request %s (%s: %s); it continues without speculation",
                           request_id, exc.code().name, exc.details())
        self.refused.update(refused)

    def lose(self, exc: BaseException, running: Iterable[RequestState]) -> None:
        """Switch to ``ar``: drop every pending draft and what the drafter was told."""
        if self.is_available:
            logger.warning("drafter unavailable (%s); continuing in ar on the verifier", exc)
        self.is_available = False
        self._next_probe = time.monotonic() + self.retry_s
        for request in running:
            request.drafts = None
            request.num_drafter_tokens = 0

    async def probe(self, engines: EngineClients, running: list[RequestState]) -> bool:
        """Try to bring the drafter back (see module docstring); returns True on success."""
        ids = sorted({r.request_id for r in running} | self._orphans)
        try:
            await _ping(engines, engines.timeout)
            if ids:
                await engines.release(engines.drafter, ids)
            self.refuse(await add_committed(engines, running))
        except grpc.aio.AioRpcError as exc:
            self._next_probe = time.monotonic() + self.retry_s
            self._num_failed_probes += 1
            if self._num_failed_probes & (self._num_failed_probes - 1) == 0:  # 1, 2, 4, 8, ...: not every retry_s forever
                logger.info("drafter still unavailable after %d probes: %s", self._num_failed_probes, exc.code())
            return False
        self._num_failed_probes = 0
        self._orphans.clear()
        self.is_available = True
        self._next_check = time.monotonic() + self.idle_check_s
        logger.info("drafter is back; speculation resumes for %d running requests", len(running))
        return True


async def _ping(engines: EngineClients, timeout_s: float) -> None:
    """GetInfo to the drafter: returns if it answers, raises grpc.aio.AioRpcError if not."""
    await engines.drafter.GetInfo(engine_pb2.EngineInfoRequest(), timeout=timeout_s)
