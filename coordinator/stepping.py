"""One coordinator step (nano-vllm style: schedule, run, postprocess), mixed into the Scheduler.

- ``ar``: verify every running request with k = 0 (plain decode).
- ``sd``: draft k tokens for the batch, then verify it (Leviathan et al. 2023).
- ``psd`` (MineDraft paper §5.1): the verifier verifies the batch other than ``skip_batch`` with
  the drafts made for it at the previous step while the drafter drafts ``skip_batch``
  (``asyncio.gather``); then tokens are committed, finished requests recycled, ``skip_batch``
  flipped. A verify batch without drafts (first step, one batch empty, after a drafter outage)
  is drafted first, i.e. that part falls back to ``sd``.

k per request comes from ``coordinator.adaptive.KChooser`` (fixed, or adaptive toward
t_draft = t_verify, with a smaller k_i for a request whose drafts are often rejected); the
requests of one Draft call may differ in k_i (ragged rows) and are verified together in one
Verify call per drafter step. A request it leaves undrafted (k = 0) is verified in a separate
Verify call with the requests that have no room for drafts. Every Draft/Verify time and every verified
draft feeds ``SpeculationStats`` (the adaptive policies' online estimates).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import grpc

from coordinator.config import Mode
from coordinator.cost_model import critical_ms
from coordinator.fallback import add_committed
from coordinator.request import RequestState, RequestStatus
from coordinator.postprocess import Committed, Postprocess
from coordinator.stats import StepStats, StepTimes
from coordinator.streamed import StreamedTokens
from coordinator.tracing import Phase, StepTrace, finish_step, start_step
from opentelemetry import trace

logger = logging.getLogger(__name__)


class StepLoop(Postprocess):
    """The step of :class:`coordinator.scheduler.Scheduler` (which provides the state it uses);
    committing the results is :class:`coordinator.postprocess.Postprocess`."""

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
        """The PSD step: schedule, draft one batch while verifying the other, commit (finished
        requests are recycled as they finish), flip. ``ar`` and ``sd`` steps take the same path
        with no draft-ahead batch."""
        start, mode, times = time.perf_counter(), self.step_mode(step_trace), StepTimes()
        verify_reqs, ahead_reqs = self._schedule(mode)
        step_trace.add_requests(verify_reqs + ahead_reqs)
        verify_batch = 1 - self.batches.skip_batch if mode == Mode.PSD else 0
        groups = await self._verify_groups(verify_reqs, mode, times, verify_batch)
        ahead_spec = self._speculative(ahead_reqs) if mode == Mode.PSD else []
        committed = await self._verify_while_drafting(groups, ahead_spec, times, verify_batch, mode)
        is_parallel = mode == Mode.PSD and bool(ahead_spec) and self.mode != Mode.AR
        self._flip(mode, bool(ahead_reqs))
        return self._record(mode, verify_reqs, committed, times, start, is_parallel, step_trace)

    async def _verify_groups(self, verify_reqs: list[RequestState], mode: Mode, times: StepTimes,
                             verify_batch: int) -> list[tuple[list, list | None]]:
        """The verify batch as Verify calls: one per drafter step among the drafted requests
        (drafted now where drafts are missing, ``_ensure_drafts``), one with k = 0 for the rest."""
        spec_reqs = await self._ensure_drafts(verify_reqs, mode, times, verify_batch)
        return _group_by_draft_step(spec_reqs, [r for r in verify_reqs if r not in spec_reqs])

    async def _verify_while_drafting(self, groups, ahead_spec: list[RequestState], times: StepTimes,
                                     verify_batch: int, mode: Mode) -> Committed:
        """Run the Verify calls of ``groups`` and, at the same time (``asyncio.gather``), the Draft
        call of the other batch's ``ahead_spec`` for the next step (psd, drafter on).

        Each Verify call's tokens are committed (and streamed) as soon as it returns, while the
        Draft call may still run, and of the two the call that took longer at the last parallel
        step is sent first (``draft_first``): in psd the longer call is the step's critical path,
        so the coordinator's own work (building the other call, committing the verified batch)
        runs beside it instead of after it. A multi-step call's tokens are committed as they
        stream in (``stream_decode_steps``). Returns what the step committed. Raises a Verify
        call's error once every call has ended."""
        verify_start_s, streamed, committed = time.time(), StreamedTokens(), Committed()
        named = {r.request_id for reqs, _ in groups for r in reqs}
        num_steps = [self._num_decode_steps(reqs) if mode == Mode.AR else 1 for reqs, _ in groups]
        on_partial = (lambda response: self._commit_partial(response, streamed, named)) if self.cfg.stream_decode_steps else None

        async def verify_and_commit(reqs, drafts, n):
            response, rpc_ms = await self.engines.verify(self.step_id, [r.request_id for r in reqs], drafts,
                                                         self._data_plane, n, on_partial, self.cfg.stream_interval,
                                                         _row_caps(reqs, n), self.cfg.stream_interval_ms)
            self._commit_group(reqs, drafts, response, rpc_ms, times, verify_start_s, verify_batch, streamed,
                               committed, named)

        calls = [verify_and_commit(reqs, d, n) for (reqs, d), n in zip(groups, num_steps)]
        drafting = bool(ahead_spec) and self.mode != Mode.AR
        draft_first = drafting and self.draft_first
        if drafting:
            draft = self._draft(ahead_spec, times, 1 - verify_batch, mode)
            calls = [draft, *calls] if draft_first else [*calls, draft]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results[int(draft_first): int(draft_first) + len(groups)]:
            if isinstance(result, BaseException):
                raise result
        draft_result = results[0 if draft_first else -1] if drafting else None
        if isinstance(draft_result, BaseException):   # not a drafter error (_draft handles those): a bug
            logger.error("step %d: the draft-ahead call failed; its batch is drafted at its verify step instead",
                         self.step_id, exc_info=draft_result)
        committed.num_emitted += streamed.num_emitted
        return committed

    def _flip(self, mode: Mode, drafted_ahead: bool) -> None:
        """psd: the batch drafted ahead is verified next step (``flip``); with no batch to draft
        ahead the Batch Manager only notes that psd started. ``auto`` running ar/sd keeps one
        batch of everything this step."""
        if mode == Mode.PSD and drafted_ahead:
            self.batches.flip()
        elif mode == Mode.PSD:
            self.batches.mark_started()
        elif self.cfg.uses_batches:
            self.batches.mark_not_started()

    async def _ensure_drafts(self, verify_reqs: list[RequestState], mode: Mode, times: StepTimes,
                             batch: int) -> list[RequestState]:
        """The requests verified with drafts this step. A verify batch where a request the policy
        wants drafted has none (sd, first psd step, newcomers, after an outage) is drafted now,
        all of it in one Draft call (one drafter step id per Verify call)."""
        if mode == Mode.AR or self.mode == Mode.AR:
            return []
        candidates = self._speculative(verify_reqs)
        ks = self.chooser.draft_ks([r.request_id for r in candidates], mode == Mode.PSD)
        # a psd probe waits for the next draft-ahead rather than drafting the whole batch now
        if any(r.drafts is None and ks[r.request_id] > 0 and not (mode == Mode.PSD and r.num_drafts
                                                                  and self.chooser.is_probe(r.request_id))
               for r in candidates):
            for request in candidates:
                request.drafts = None
            await self._draft(candidates, times, batch, mode)  # sd part: drafts needed before this verify
        return [r for r in candidates if r.drafts is not None]

    def _num_decode_steps(self, requests: list[RequestState]) -> int:
        """Tokens per request that this ``ar`` step's Verify call decodes: ``num_decode_steps``,
        at most what the request with the most left still needs (``max_tokens``) and what the
        fullest context window leaves (``coordinator.context_window``)."""
        n = self.cfg.num_decode_steps
        if n == 1 or not requests:
            return 1
        wanted = max(_tokens_left(r) for r in requests)
        room = min(self.limits.decode_room(len(r.prompt_token_ids) + len(r.output_token_ids)) for r in requests)
        return max(1, min(n, wanted, room))

    def _speculative(self, requests: list[RequestState]) -> list[RequestState]:
        """The requests with room for k_max draft tokens in both engines' KV (``coordinator.context_window``)
        that the drafter has not refused (``coordinator.fallback``)."""
        k, refused = self.cfg.num_speculative_tokens, self.drafter_link.refused
        return [r for r in requests if self.limits.can_speculate(len(r.committed), k) and r.request_id not in refused]

    def _schedule(self, mode: Mode) -> tuple[list[RequestState], list[RequestState]]:
        """(requests to verify now, requests to draft ahead for the next step)."""
        if mode != Mode.PSD:
            return list(self.running.values()), []
        if self.batches.is_empty(1 - self.batches.skip_batch):
            self.batches.flip()  # one batch empty: verify the other (sd fallback), newcomers draft
        migrant = self.balancer.pick_migration(self.batches, self.cfg.max_num_seqs, self._cost_of)
        if migrant is not None:  # feedback balancer: drafted again now, verified next step
            self.batches.move(migrant, self.batches.skip_batch)
            self.running[migrant].drafts = None
            self.metrics.num_migrations.inc()
        verify = [self.running[r] for r in self.batches.verify_batch()]
        ahead = [self.running[r] for r in self.batches.draft_batch()]
        return verify, ahead

    async def _draft(self, requests: list[RequestState], times: StepTimes, batch: int, mode: Mode) -> None:
        """Draft for the ``requests`` the k policy wants drafted (PSD batch ``batch``); on a
        drafter failure switch to ``ar``."""
        ks = self.chooser.draft_ks([r.request_id for r in requests], mode == Mode.PSD)
        requests = [r for r in requests if ks[r.request_id] > 0]
        if not requests:
            return
        start_s = time.time()
        try:
            requests = await self._add_to_drafter(requests)
            if not requests:
                return
            self._num_draft_calls += 1  # drafter step ids are unique per Draft call (dist plane key)
            row_ks = [ks[r.request_id] for r in requests]
            result = await self.engines.draft(self._num_draft_calls, requests, row_ks, self._data_plane)
        except (grpc.aio.AioRpcError, ValueError) as exc:
            self._lose_drafter(exc)
            return
        for request, drafts in zip(requests, result.drafts):
            if request.status == RequestStatus.RUNNING:
                request.drafts = drafts
        self.spec_stats.cost.observe_draft(len(requests), max(row_ks), result.draft_ms)  # max k_i steps ran
        times.draft_ms += result.draft_ms
        times.phases.append(Phase("drafter", batch, start_s, result.draft_ms, result.wall_ms, len(requests),
                                  result.service_ms, result.sent_s, result.service_start_s))
        times.data_plane_ms += result.data_plane_ms
        times.num_drafted += len(requests)

    async def _add_to_drafter(self, requests: list[RequestState]) -> list[RequestState]:
        """The ``requests`` that can be drafted now. Requests ``auto`` admitted while it ran ``ar``
        (``num_drafter_tokens == 0``) are added to the drafter first, in one AddRequests call, with
        their committed tokens but the last as the prompt (as after a drafter outage), so ``ar``
        never waits for a drafter prefill; one it refuses runs undrafted. Raises
        grpc.aio.AioRpcError on a drafter transport error."""
        missing = [r for r in requests if r.num_drafter_tokens == 0
                   and self.limits.fits_drafter(len(r.committed) - 1)]
        refused = await add_committed(self.engines, missing)
        self.drafter_link.refuse(refused)
        self.metrics.num_lazy_drafter_adds.inc(len(missing) - len(refused))
        return [r for r in requests if r.num_drafter_tokens > 0]

    def _record(self, mode, verify_reqs, committed: Committed, times, start, is_parallel,
                step_trace: StepTrace) -> StepStats:
        """The step's ``StepStats``, fed to the totals, the k and auto policies, the trace and the metrics."""
        num_spec_tokens, accepted, num_emitted = committed.num_spec_tokens, committed.accepted, committed.num_emitted
        k = max(num_spec_tokens, default=0)
        wall_ms = (time.perf_counter() - start) * 1e3
        stats = StepStats(
            mode=str(mode), step_id=self.step_id, num_verify=len(verify_reqs), num_draft=times.num_drafted, k=k,
            num_draft_tokens=sum(num_spec_tokens), num_accepted_tokens=sum(accepted), num_emitted_tokens=num_emitted,
            draft_ms=times.draft_ms, verify_ms=times.verify_ms, data_plane_ms=times.data_plane_ms,
            idle_ms=max(wall_ms - times.verify_ms, 0.0), wall_ms=wall_ms, is_parallel=is_parallel,
        )
        self.totals.record(stats)
        if is_parallel:  # the next parallel step sends the call that took longer first
            self.draft_first = times.draft_ms >= times.verify_ms
        critical = critical_ms(times.draft_ms, times.verify_ms, is_parallel)
        self.spec_stats.cost.observe_step(wall_ms, critical)  # the fixed cost the k policy adds to T
        if self.cfg.mode == Mode.AUTO:  # live goodput of the mode auto chose (coordinator.auto_mode)
            self.auto.observe_step(str(mode), num_emitted, wall_ms)
        finish_step(step_trace, stats, times.phases)
        if self.step_log is not None:
            self.step_log.write(step_trace, stats, times.phases)
        self.metrics.observe_step(stats)
        self.metrics.observe_totals(self.totals)
        self.metrics.observe_state(self.batches.batch_sizes(), self.batches.balance, len(self.running),
                                   len(self.waiting), self.is_drafter_available)
        return stats


def _group_by_draft_step(spec_reqs: list[RequestState],
                         plain_reqs: list[RequestState]) -> list[tuple[list, list | None]]:
    """One Verify call per drafter step among the drafted requests (their k_i may differ: ragged
    rows), plus one with k = 0 for the undrafted ones."""
    by_draft: dict[int, list[RequestState]] = defaultdict(list)
    for request in spec_reqs:
        by_draft[request.drafts.step_id].append(request)
    groups: list[tuple[list, list | None]] = [(reqs, [r.drafts for r in reqs]) for reqs in by_draft.values()]
    return groups + ([(plain_reqs, None)] if plain_reqs else [])


def _row_caps(requests: list[RequestState], num_steps: int) -> list[int]:
    """A multi-step call's ``max_decode_steps``: per request the tokens it has left before
    ``max_tokens`` where that is fewer than ``num_steps`` (the verifier then ends its row there and
    streams its last tokens at once); empty when no row would stop early or the call is one step."""
    caps = [max(1, _tokens_left(r)) for r in requests]
    return caps if num_steps > 1 and min(caps, default=num_steps) < num_steps else []


def _tokens_left(request: RequestState) -> int:
    """Output tokens ``request`` may still emit before its ``max_tokens``."""
    return request.finish_params.max_tokens - len(request.output_token_ids)
