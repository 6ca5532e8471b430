"""The coordinator's step loop: admission, ``ar`` / ``sd`` / ``psd`` steps, finish, abort, fallback.

One async loop owns every engine RPC, so engine state changes only at step boundaries:
``sync`` (release finished/aborted KV, probe a lost drafter) -> ``admit`` (FIFO queue, prefill on
both engines; the verifier's first token is streamed at once = TTFT) -> ``step``.

A step (nano-vllm style: schedule, run, postprocess):
- ``ar``: verify every running request with k = 0 (plain decode).
- ``sd``: draft k tokens for the batch, then verify it (Leviathan et al. 2023).
- ``psd`` (MineDraft paper §5.1): the verifier verifies the batch other than ``skip_batch`` with
  the drafts made for it at the previous step while the drafter drafts ``skip_batch``
  (``asyncio.gather``); then tokens are committed, finished requests recycled, ``skip_batch``
  flipped. A verify batch without drafts (first step, one batch empty, after a drafter outage)
  is drafted first, i.e. that part falls back to ``sd``.
If the drafter fails, every request continues in ``ar`` on the verifier and the drafter is probed
every ``drafter_retry_s``; on recovery the requests are re-added to it and speculation resumes
(``coordinator.fallback``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc

from minedraft.v1 import engine_pb2

from coordinator.batch_manager import BatchManager
from coordinator.config import CoordinatorConfig, DataPlaneKind, Mode
from coordinator.context_window import ContextLimits
from coordinator.engines import EngineClients
from coordinator.fallback import DrafterLink
from coordinator.finish import FinishReason, apply_finish
from coordinator.metrics import CoordinatorMetrics
from coordinator.request import RequestState, RequestStatus
from coordinator.stats import StepStats, StepTimes, StepTotals
from coordinator.tracing import Phase, StepLog, StepTrace, finish_step, start_step
from opentelemetry import trace

logger = logging.getLogger(__name__)

_DATA_PLANE = {DataPlaneKind.INLINE: engine_pb2.DATA_PLANE_INLINE, DataPlaneKind.DIST: engine_pb2.DATA_PLANE_DIST}


_ERROR_BACKOFF_S = 0.1  # pause after an unexpected error so a persistent one cannot spin the loop


class QueueFullError(Exception):
    """The waiting queue holds ``max_queue_len`` requests."""


class Scheduler:
    """Request lifecycle and step loop over a drafter and a verifier (see module docstring).

    Args:
        cfg: the coordinator configuration.
        engines: gRPC clients of both engines.
        eos_token_ids: the target model's EOS ids (from the verifier's ``GetInfo``).
        num_engine_slots: free KV slots of the engines at start (min over the engines used).
    """

    def __init__(self, cfg: CoordinatorConfig, engines: EngineClients, eos_token_ids: tuple[int, ...],
                 num_engine_slots: int) -> None:
        self.cfg, self.engines, self.eos_token_ids = cfg, engines, eos_token_ids
        self.max_num_running = min(cfg.max_num_running, num_engine_slots)
        self.waiting: collections.OrderedDict[str, RequestState] = collections.OrderedDict()
        self.running: dict[str, RequestState] = {}
        self.batches = BatchManager()
        self.drafter_link = DrafterLink(cfg.uses_drafter, cfg.drafter_retry_s)
        self.totals = StepTotals()
        self.metrics = CoordinatorMetrics()
        self.step_id = 0
        self._to_release: set[str] = set()
        self._num_draft_calls = 0
        self._wakeup = asyncio.Event()
        self._data_plane = _DATA_PLANE[cfg.data_plane]
        self.step_log = StepLog(cfg.step_log) if cfg.step_log else None
        self.limits = ContextLimits()  # the engines' max_model_len; set by coordinator.server.start

    # ------------------------------------------------------------------ public API
    def submit(self, request: RequestState) -> None:
        """Queue a new request (FIFO). Raises QueueFullError, or ValueError on a duplicate id."""
        if request.request_id in self.waiting or request.request_id in self.running:
            raise ValueError(f"request_id: {request.request_id!r} is already in flight")
        if len(self.waiting) >= self.cfg.max_queue_len:
            raise QueueFullError(f"waiting queue is full ({self.cfg.max_queue_len} requests)")
        self.waiting[request.request_id] = request
        self._wakeup.set()

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request: finish it with "abort", drop its pending drafts,
        and release its KV in both engines at the next sync point. Returns False if unknown."""
        request = self.waiting.pop(request_id, None)
        if request is not None:
            request.finish(FinishReason.ABORT)
            return True
        if request_id not in self.running:
            return False
        self._retire(self.running[request_id], FinishReason.ABORT)
        self._wakeup.set()
        return True

    @property
    def mode(self) -> Mode:
        """The mode the loop runs now (``ar`` while the drafter is unavailable)."""
        return self.cfg.mode if self.is_drafter_available else Mode.AR

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
        if self.running:
            await self.step()
        elif not self.waiting and not self._to_release:
            self._wakeup.clear()
            await self._wakeup.wait()

    # ------------------------------------------------------------------ sync and admission
    async def _sync(self) -> None:
        """Release the KV of finished/aborted requests; probe a lost drafter when due."""
        if self._to_release:
            ids, self._to_release = sorted(self._to_release), set()
            self.drafter_link.note_released(ids)
            await self._release(ids)
        if self.drafter_link.is_due:
            await self.drafter_link.probe(self.engines, self._speculative(list(self.running.values())))

    async def _release(self, ids: list[str]) -> None:
        stubs = [self.engines.verifier] + ([self.engines.drafter] if self.is_drafter_available else [])
        results = await asyncio.gather(*(self.engines.release(s, ids) for s in stubs), return_exceptions=True)
        for stub, result in zip(stubs, results):
            if isinstance(result, Exception):
                logger.warning("release of %d requests failed: %s", len(ids), result)
                if stub is self.engines.drafter:
                    self._lose_drafter(result)
                    self.drafter_link.note_released(ids)  # released there once it is back

    async def _admit(self) -> None:
        # slots of finished/aborted requests count until their release RPC has run
        num_free = self.max_num_running - len(self.running) - len(self._to_release)
        if self.cfg.mode == Mode.PSD and self.batches.is_started:  # newcomers join skip_batch: keep it <= m
            num_free = min(num_free, self.cfg.max_num_seqs - len(self.batches.draft_batch()))
        new = [self.waiting.popitem(last=False)[1] for _ in range(min(num_free, len(self.waiting)))]
        if not new:
            return
        for request in new:
            request.status = RequestStatus.RUNNING
            self.running[request.request_id] = request
            if request.trace is not None:
                request.trace.on_admit()
        seqs = [engine_pb2.SeqInit(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, sampling=r.sampling)
                for r in new]
        drafted = [r for r in new if self.limits.fits_drafter(len(r.prompt_token_ids))]
        is_drafting = self.mode != Mode.AR and bool(drafted)
        calls = [self.engines.prefill_verifier(seqs)]
        if is_drafting:  # a prompt longer than the draft's window runs without speculation
            draft_seqs = [seq for seq, r in zip(seqs, new) if r in drafted]
            calls.append(self.engines.add_requests(self.engines.drafter, draft_seqs))
        results = await asyncio.gather(*calls, return_exceptions=True)
        if is_drafting and isinstance(results[1], Exception):
            self._lose_drafter(results[1])
        elif is_drafting:
            for request in drafted:
                request.num_drafter_tokens = len(request.prompt_token_ids)
        self._start_requests(new, results[0])

    def _start_requests(self, new: list[RequestState], outputs: dict[str, object]) -> None:
        """Stream each first token (TTFT) and place the survivors in the Batch Manager."""
        alive = []
        for request in new:
            out = outputs.get(request.request_id)
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while prefilling; its release is queued
            if isinstance(out, grpc.aio.AioRpcError):
                self._retire(request, None, error=(out.code(), f"verifier prefill failed: {out.details()}"))
            elif out is None:
                self._retire(request, None, error=(grpc.StatusCode.INTERNAL, "verifier returned no first token"))
            elif self._commit(request, list(out.token_ids), list(out.logprobs), 0, 0, list(out.top_logprobs)):
                alive.append(request.request_id)
        if self.cfg.mode == Mode.PSD:
            self.batches.assign(alive)

    # ------------------------------------------------------------------ the step
    async def step(self) -> StepStats:
        """Run one step in the current mode and return its record (also added to ``totals``).
        The step runs inside its ``coordinator.step`` span (``coordinator.tracing``)."""
        self.step_id += 1
        step_trace = start_step(self.step_id)
        with trace.use_span(step_trace.span, end_on_exit=False):
            try:
                return await self._run_step(step_trace)
            except BaseException as exc:
                step_trace.span.record_exception(exc)
                step_trace.span.end()
                raise

    async def _run_step(self, step_trace: StepTrace) -> StepStats:
        start, mode, times = time.perf_counter(), self.mode, StepTimes()
        verify_reqs, ahead_reqs = self._schedule(mode)
        step_trace.add_requests(verify_reqs + ahead_reqs)
        verify_batch = 1 - self.batches.skip_batch if mode == Mode.PSD else 0
        spec_reqs = self._speculative(verify_reqs) if mode != Mode.AR else []
        if any(r.drafts is None for r in spec_reqs):
            await self._draft(spec_reqs, times, verify_batch)  # sd part: drafts needed before this verify
        drafts = [r.drafts for r in spec_reqs] if spec_reqs and all(r.drafts for r in spec_reqs) else None
        if drafts is None:
            spec_reqs = []  # the drafter failed: everything is verified with k = 0
        plain_reqs = [r for r in verify_reqs if r not in spec_reqs]
        ahead_spec = self._speculative(ahead_reqs)
        groups = [(reqs, d) for reqs, d in ((spec_reqs, drafts), (plain_reqs, None)) if reqs]
        verify_start_s = time.time()
        calls = [self.engines.verify(self.step_id, [r.request_id for r in reqs], d, self._data_plane)
                 for reqs, d in groups]
        if ahead_spec and self.mode != Mode.AR:
            calls.append(self._draft(ahead_spec, times, 1 - verify_batch))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results[: len(groups)]:
            if isinstance(result, BaseException):
                raise result
        num_emitted, accepted = 0, []
        for (reqs, d), (response, verify_rpc_ms) in zip(groups, results[: len(groups)]):
            times.phases.append(Phase("verifier", verify_batch, verify_start_s, response.verify_ms, verify_rpc_ms,
                                      len(reqs)))
            times.verify_ms += response.verify_ms
            times.data_plane_ms += response.data_plane_ms
            group_emitted, group_accepted = self._postprocess(reqs, d, response)
            num_emitted += group_emitted
            accepted += group_accepted if d else []
        is_parallel = mode == Mode.PSD and bool(ahead_spec) and self.mode == Mode.PSD
        if mode == Mode.PSD and ahead_reqs:
            self.batches.flip()
        elif mode == Mode.PSD:
            self.batches.mark_started()
        return self._record(mode, verify_reqs, drafts, times, accepted, num_emitted, start, is_parallel, step_trace)

    def _speculative(self, requests: list[RequestState]) -> list[RequestState]:
        """The requests with room for k draft tokens in both engines' KV (``coordinator.context_window``)."""
        k = self.cfg.num_speculative_tokens
        return [r for r in requests if self.limits.can_speculate(len(r.committed), k)]

    def _schedule(self, mode: Mode) -> tuple[list[RequestState], list[RequestState]]:
        """(requests to verify now, requests to draft ahead for the next step)."""
        if mode != Mode.PSD:
            return list(self.running.values()), []
        if self.batches.is_empty(1 - self.batches.skip_batch):
            self.batches.flip()  # one batch empty: verify the other (sd fallback), newcomers draft
        verify = [self.running[r] for r in self.batches.verify_batch()]
        ahead = [self.running[r] for r in self.batches.draft_batch()]
        return verify, ahead

    async def _draft(self, requests: list[RequestState], times: StepTimes, batch: int) -> None:
        """Draft for ``requests`` (PSD batch ``batch``); on a drafter failure switch to ``ar``."""
        self._num_draft_calls += 1  # drafter step ids are unique per Draft call (dist plane key)
        start_s = time.time()
        try:
            result = await self.engines.draft(self._num_draft_calls, requests, self.cfg.num_speculative_tokens,
                                              self._data_plane)
        except (grpc.aio.AioRpcError, ValueError) as exc:
            self._lose_drafter(exc)
            return
        for request, drafts in zip(requests, result.drafts):
            if request.status == RequestStatus.RUNNING:
                request.drafts = drafts
        times.draft_ms += result.draft_ms
        times.phases.append(Phase("drafter", batch, start_s, result.draft_ms, result.wall_ms, len(requests)))
        times.data_plane_ms += result.data_plane_ms
        times.num_drafted += len(requests)

    def _postprocess(self, verify_reqs, drafts, response: engine_pb2.VerifyResponse) -> tuple[int, list[int]]:
        """Commit each verified request's tokens; returns (tokens emitted, accepted count per request)."""
        outputs = {out.request_id: out for out in response.outputs}
        k = len(drafts[0].token_ids) if drafts else 0
        num_emitted, accepted = 0, []
        for request in verify_reqs:
            request.drafts = None
            out = outputs.get(request.request_id)
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if out is None:
                self._retire(request, None, error=(grpc.StatusCode.INTERNAL, "verifier returned no output"))
                continue
            before, accepted_before = len(request.output_token_ids), request.num_accepted_tokens
            self._commit(request, list(out.token_ids), list(out.logprobs), k, out.num_accepted,
                         list(out.top_logprobs))
            num_emitted += len(request.output_token_ids) - before
            accepted.append(request.num_accepted_tokens - accepted_before)  # emitted ones only
        return num_emitted, accepted

    def _commit(self, request: RequestState, token_ids: list[int], logprobs: list[float], k: int,
                num_accepted: int, top_logprobs: list = ()) -> bool:
        """Apply finish rules to a committed block, stream it; returns True if still running.
        ``top_logprobs``: one ``common_pb2.TopLogprobs`` per token when the request asked for them."""
        emitted, reason = apply_finish(token_ids, len(request.output_token_ids), request.finish_params,
                                       self.eos_token_ids)
        num_accepted_emitted = min(num_accepted, len(emitted))
        request.output_token_ids += emitted
        request.num_draft_tokens += k
        request.num_accepted_tokens += num_accepted_emitted
        request.num_drafts += int(k > 0)
        if emitted:
            request.send_chunk(emitted, logprobs[: len(emitted)], k, num_accepted_emitted,
                               top_logprobs[: len(emitted)])
        if reason is not None:
            self._retire(request, reason)
        return reason is None

    def _record(self, mode, verify_reqs, drafts, times, accepted, num_emitted, start, is_parallel,
                step_trace: StepTrace) -> StepStats:
        k = len(drafts[0].token_ids) if drafts else 0
        wall_ms = (time.perf_counter() - start) * 1e3
        stats = StepStats(
            mode=str(mode), step_id=self.step_id, num_verify=len(verify_reqs), num_draft=times.num_drafted, k=k,
            num_draft_tokens=k * len(accepted), num_accepted_tokens=sum(accepted), num_emitted_tokens=num_emitted,
            draft_ms=times.draft_ms, verify_ms=times.verify_ms, data_plane_ms=times.data_plane_ms,
            idle_ms=max(wall_ms - times.verify_ms, 0.0), wall_ms=wall_ms, is_parallel=is_parallel,
        )
        self.totals.record(stats)
        finish_step(step_trace, stats, times.phases)
        if self.step_log is not None:
            self.step_log.write(step_trace, stats, times.phases)
        self.metrics.observe_step(stats, accepted if k else [])
        self.metrics.observe_totals(self.totals)
        self.metrics.observe_state(self.batches.batch_sizes(), self.batches.balance, len(self.running),
                                   len(self.waiting), self.is_drafter_available)
        return stats

    # ------------------------------------------------------------------ retire, failures
    def _retire(self, request: RequestState, reason: FinishReason | None, error: tuple | None = None) -> None:
        """Remove a running request (finish or error), and queue its KV release in both engines."""
        self.running.pop(request.request_id, None)
        self.batches.recycle(request.request_id)
        self._to_release.add(request.request_id)
        if error is not None:
            code, message = error
            request.fail(code.value[0], message)
        else:
            request.finish(reason)

    def _fail_running(self, code: grpc.StatusCode, message: str) -> None:
        for request in list(self.running.values()):
            self._retire(request, None, error=(code, message))

    def _lose_drafter(self, exc: BaseException) -> None:
        self.drafter_link.lose(exc, self.running.values())
