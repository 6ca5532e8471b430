"""The coordinator's step loop: admission, ``ar`` / ``sd`` / ``psd`` steps, finish, abort, fallback.

One async loop owns every engine RPC, so engine state changes only at step boundaries:
``sync`` (release finished/aborted KV, probe a lost drafter) -> ``admit`` (FIFO queue, prefill on
both engines; the verifier's first token is streamed at once = TTFT) -> ``step``.

A step (schedule, run, postprocess; ``ar``, ``sd``, ``psd``, adaptive k) is ``coordinator.stepping``
(its commit side ``coordinator.postprocess``); admission is ``coordinator.admitting``.
If the drafter fails, every request continues in ``ar`` on the verifier and the drafter is probed
every ``drafter_retry_s``; on recovery the requests are re-added to it and speculation resumes
(``coordinator.fallback``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import grpc

from minedraft.v1 import engine_pb2

from coordinator.adaptive import KChooser, SpeculationStats
from coordinator.admission import EngineSlots
from coordinator.auto_mode import AutoDecision, AutoMode
from coordinator.balancer import Balancer, BalancerConfig
from coordinator.batch_manager import BatchManager
from coordinator.config import CoordinatorConfig, DataPlaneKind, Mode
from coordinator.context_window import ContextLimits
from coordinator.emitted import EmittedCounter
from coordinator.engines import EngineClients
from coordinator.fallback import DrafterLink
from coordinator.finish import FinishReason
from coordinator.metrics import CoordinatorMetrics
from coordinator.request import RequestState
from coordinator.stats import StepTotals
from coordinator.streamed import EarlyTokens
from coordinator.admitting import Admitting
from coordinator.stepping import StepLoop
from coordinator.tracing import StepLog

logger = logging.getLogger(__name__)

_DATA_PLANE = {DataPlaneKind.INLINE: engine_pb2.DATA_PLANE_INLINE, DataPlaneKind.DIST: engine_pb2.DATA_PLANE_DIST}


_ERROR_BACKOFF_S = 0.1  # pause after an unexpected error so a persistent one cannot spin the loop


class QueueFullError(Exception):
    """The waiting queue holds ``max_queue_len`` requests."""


class Scheduler(Admitting, StepLoop):
    """Request lifecycle and step loop over a drafter and a verifier (see module docstring).

    Args:
        cfg: the coordinator configuration.
        engines: gRPC clients of both engines.
        eos_token_ids: the target model's EOS ids (from the verifier's ``GetInfo``).
        slots: free KV slots of each engine at start; admission takes at most what both hold
            (``coordinator.admission``).
    """

    def __init__(self, cfg: CoordinatorConfig, engines: EngineClients, eos_token_ids: tuple[int, ...],
                 slots: EngineSlots) -> None:
        self.cfg, self.engines, self.eos_token_ids, self.slots = cfg, engines, eos_token_ids, slots
        self.max_num_running = slots.max_num_running(cfg)
        self.waiting: collections.OrderedDict[str, RequestState] = collections.OrderedDict()
        self.running: dict[str, RequestState] = {}
        self.batches = BatchManager()
        self.drafter_link = DrafterLink(cfg.uses_drafter, cfg.drafter_retry_s)
        self.totals = StepTotals()
        self.metrics = CoordinatorMetrics()
        self.emitted = EmittedCounter(self.metrics, self.totals)
        self.step_id = 0
        self._to_release: set[str] = set()
        self._num_draft_calls = 0
        self._wakeup = asyncio.Event()
        self._data_plane = _DATA_PLANE[cfg.data_plane]
        self.step_log = StepLog(cfg.step_log) if cfg.step_log else None
        self.limits = ContextLimits()  # the engines' max_model_len; set by coordinator.server.start
        self.spec_stats = SpeculationStats()
        self.chooser = KChooser(cfg.k_policy, cfg.num_speculative_tokens, self.spec_stats)
        self.balancer = Balancer(BalancerConfig(cfg.balancer))
        self.auto = AutoMode(self.chooser, cfg.max_num_seqs)
        self.last_auto_decision: AutoDecision | None = None
        self._is_head_held = False
        self.joined_outputs: list[engine_pb2.SeqOutput] = []  # tokens of requests that joined a Verify call
        self.early_tokens = EarlyTokens()  # their streamed tokens that came before their first
        self.draft_first = True   # psd: send the Draft call before the Verify calls (it took longer last time)

    # ------------------------------------------------------------------ public API
    def submit(self, request: RequestState) -> None:
        """Queue a new request (FIFO). Raises QueueFullError, or ValueError on a duplicate id."""
        if request.request_id in self.waiting or request.request_id in self.running:
            raise ValueError(f"request_id: {request.request_id!r} is already in flight")
        if len(self.waiting) >= self.cfg.max_queue_len:
            raise QueueFullError(f"waiting queue is full ({self.cfg.max_queue_len} requests)")
        self.waiting[request.request_id] = request
        self._wakeup.set()

    def abort(self, request_id: str, request: RequestState | None = None,
              num_output_tokens: int | None = None) -> bool:
        """Abort a waiting or running request: finish it with "abort", drop its pending drafts,
        and release its KV in both engines at the next sync point. Returns False if unknown.
        With ``request``, only that request: a stream cleaning up after itself must not abort a
        newer request that reuses its id; its counters, if held, wait for the gateway's Abort.
        Without ``request`` (the Abort RPC) it also settles the request's held counters
        (``coordinator.emitted``) at ``num_output_tokens`` (None: all), running or finished."""
        found = self.waiting.get(request_id, self.running.get(request_id))
        if found is None or (request is not None and found is not request):
            if request is None:
                self.emitted.settle(request_id, num_output_tokens)
            return False
        if self.waiting.pop(request_id, None) is not None:
            found.finish(FinishReason.ABORT)
            return True
        self._retire(found, FinishReason.ABORT)
        if request is None:
            self.emitted.settle(request_id, num_output_tokens)
        self._wakeup.set()
        return True

    @property
    def mode(self) -> Mode:
        """The mode the loop runs now (``ar`` while the drafter is unavailable)."""
        return self.cfg.mode if self.is_drafter_available else Mode.AR

    @property
    def effective_mode(self) -> Mode:
        """The mode steps run in now: :attr:`mode`, or in ``auto`` the last step's choice."""
        if self.cfg.mode == Mode.AUTO and self.last_auto_decision is not None and self.is_drafter_available:
            return self.last_auto_decision.mode
        return self.mode

    def step_mode(self, step_trace=None) -> Mode:
        """The mode of the next step: :attr:`mode` (``ar`` while the drafter is unavailable); in
        ``auto`` the :class:`AutoMode` choice, recorded on the step's span and in metrics."""
        if self.cfg.mode != Mode.AUTO:
            return self.mode
        decision = self.auto.choose(self.batches.batch_sizes(), len(self.waiting), self.is_drafter_available)
        self.metrics.auto_decisions.labels(mode=str(decision.mode), reason=decision.reason).inc()
        if step_trace is not None and step_trace.span.is_recording():
            step_trace.span.set_attributes(decision.attributes())
        self.last_auto_decision = decision
        return decision.mode

    @property
    def is_drafter_available(self) -> bool:
        return self.drafter_link.is_available

    async def run(self) -> None:
        """Run the step loop until cancelled. A verifier failure fails the running requests
        (UNAVAILABLE etc.); the loop keeps serving the next ones."""
        while True:
            try:
                await self._iterate()
            except grpc.aio.AioRpcError as exc:
                logger.error("verifier call failed at step %d: %s", self.step_id, exc.code())
                self._fail_running(exc.code(), f"verifier: {exc.details()}")
            except Exception as exc:  # a bug or malformed response must not stop other requests
                logger.exception("step %d failed", self.step_id)
                self._fail_running(grpc.StatusCode.INTERNAL, f"step failed: {exc}")
                await asyncio.sleep(_ERROR_BACKOFF_S)

    async def wait_idle(self, poll_s: float = 0.05) -> None:
        """Return once no request is waiting or running (used to drain on shutdown)."""
        while self.waiting or self.running:
            await asyncio.sleep(poll_s)

    async def _iterate(self) -> None:
        await self._sync()
        await self._admit()
        if self.running and self._admits_during_step:
            await self._step_admitting()
        elif self.running:
            await self.step()
        elif not self.waiting and not self._to_release:
            await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        """Sleep until a request arrives, or until the drafter's next probe (while it is away) or idle
        check (while it is up) is due, so ``drafter_available`` follows it without a request."""
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), self.drafter_link.probe_wait_s)

    # ------------------------------------------------------------------ sync
    async def _sync(self) -> None:
        """Release the KV of finished/aborted requests; while idle, check that the drafter still
        answers (``DrafterLink.check_idle``); probe a lost drafter when due."""
        if self._to_release:
            ids, self._to_release = sorted(self._to_release), set()
            self.drafter_link.note_released(ids)
            await self._release(ids)
        if not self.running and (lost := await self.drafter_link.check_idle(self.engines)) is not None:
            self._lose_drafter(lost)
        if self.drafter_link.is_due:
            await self.drafter_link.probe(self.engines, self._speculative(list(self.running.values())))
        self.metrics.is_drafter_available.set(int(self.is_drafter_available))  # also when idle

    async def _release(self, ids: list[str]) -> None:
        stubs = [self.engines.verifier] + ([self.engines.drafter] if self.is_drafter_available else [])
        results = await asyncio.gather(*(self.engines.release(s, ids) for s in stubs), return_exceptions=True)
        for stub, result in zip(stubs, results):
            if isinstance(result, Exception):
                logger.warning("release of %d requests failed: %s", len(ids), result)
                if stub is self.engines.drafter:
                    self._lose_drafter(result)
                    self.drafter_link.note_released(ids)  # released there once it is back

    def _cost_of(self, request_id: str) -> float:
        """Expected verify cost of a running request (``coordinator.balancer``)."""
        request = self.running[request_id]
        positions = self.chooser.request_k(request_id, self.chooser.max_k) + 1
        return self.balancer.request_cost(positions, len(request.committed))

    # ------------------------------------------------------------------ retire, failures
    def _retire(self, request: RequestState, reason: FinishReason | None, error: tuple | None = None) -> None:
        """Remove a running request (finish or error), and queue its KV release in both engines."""
        self.running.pop(request.request_id, None)
        self.batches.recycle(request.request_id)
        self.spec_stats.forget(request.request_id)
        self._to_release.add(request.request_id)
        self.emitted.on_retire(request)
        if error is not None:
            code, message = error
            request.fail(code.value[0], message)
            self.emitted.settle(request.request_id)  # the gateway ends the stream without cutting it
        else:
            request.finish(reason)

    def _fail_running(self, code: grpc.StatusCode, message: str) -> None:
        for request in list(self.running.values()):
            self._retire(request, None, error=(code, message))

    def _lose_drafter(self, exc: BaseException) -> None:
        self.drafter_link.lose(exc, self.running.values())
