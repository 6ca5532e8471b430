"""Admission, mixed into the Scheduler: move waiting requests into the running set, prefill them
on the verifier (first token: TTFT) and add them to the drafter, and place them in the Batch
Manager's batches (``coordinator.balancer``). Capacity over both engines' KV slots is
``coordinator.admission``; this module decides how many to admit now and admits them.

In ``ar`` with multi-step decoding a step is long, so requests arriving during it are admitted
at once (``_step_admitting``): their prefill runs beside the step's Verify call.
"""

from __future__ import annotations

import asyncio

import grpc

from minedraft.v1 import engine_pb2

from coordinator.admission import num_within_token_budget
from coordinator.config import Mode
from coordinator.request import RequestState, RequestStatus


class Admitting:
    """Admission of the :class:`coordinator.scheduler.Scheduler` (which provides the state it uses)."""

    @property
    def _admits_during_step(self) -> bool:
        """``ar`` with multi-step decoding: a step is long (``num_decode_steps`` tokens per
        request), so newcomers are admitted while it runs rather than after it."""
        return self.cfg.mode == Mode.AR and self.cfg.num_decode_steps > 1

    async def _step_admitting(self) -> None:
        """One step, with the requests that arrive meanwhile admitted at once: their prefill
        goes to the verifier beside the running Verify call (the vLLM engine prefills them
        between two of the call's decode steps and answers with the first token: TTFT; the
        native engine after the call), and they decode from the next step on. Admissions run
        beside each other: a request that arrives while an earlier one waits for its first
        token is sent at once, not after it (vLLM admits at every engine step). The step's
        error, or else an admission's, is raised once every admission under way has finished."""
        step = asyncio.ensure_future(self.step())
        admissions: list[asyncio.Future] = []
        try:
            while not step.done():
                arrival = asyncio.ensure_future(self._wakeup.wait())
                await asyncio.wait({step, arrival}, return_when=asyncio.FIRST_COMPLETED)
                arrival.cancel()
                self._wakeup.clear()  # arrivals after this wake the next wait
                if not step.done() and self.waiting:
                    admissions.append(asyncio.ensure_future(self._admit()))
        finally:
            under_way = [f for f in (step, *admissions) if not f.done()]
            if under_way:
                await asyncio.wait(under_way)
        errors = [f.exception() for f in (step, *admissions) if f.exception() is not None]
        self._commit_joined()
        if errors:
            raise errors[0]

    def _commit_joined(self) -> None:
        """Commit the tokens that requests admitted during the step decoded inside its Verify
        call (after their first token, which their admission committed); the engine holds them,
        so a request whose first token is missing fails rather than skip them."""
        outputs, self.joined_outputs = self.joined_outputs, []
        for out in outputs:
            if not out.token_ids:
                continue  # the call's partial messages brought them all
            request = self.running.get(out.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished at its first token, or aborted meanwhile
            if not request.output_token_ids:
                self._retire(request, None, error=(grpc.StatusCode.INTERNAL, "verifier decoded a joined request "
                                                                             "before its first token"))
                continue
            self._commit_output(request, out)

    async def _admit(self) -> None:
        """Admit what both engines and the batches have room for: prefill on the verifier and add
        to the drafter at once (``asyncio.gather``); a drafter failure switches to ``ar``."""
        # slots of finished/aborted requests count until their release RPC has run
        num_free = self.max_num_running - len(self.running) - len(self._to_release)
        if self.cfg.uses_batches and self.batches.is_started:  # newcomers join the drafted batch: keep it <= m
            target = self.balancer.effective_skip(self.batches) if self.balancer.is_feedback else self.batches.skip_batch
            num_free = min(num_free, self.cfg.max_num_seqs - len(self.batches.batch(target)))
        new = [self.waiting.popitem(last=False)[1] for _ in range(self._num_to_admit(num_free))]
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
        # auto running ar adds newcomers to the drafter on their first draft (StepLoop._add_to_drafter)
        is_lazy = self.cfg.mode == Mode.AUTO and self.effective_mode == Mode.AR
        is_drafting = self.mode != Mode.AR and bool(drafted) and not is_lazy
        calls = [self.engines.prefill_verifier(seqs)]
        if is_drafting:  # a prompt longer than the draft's window runs without speculation
            draft_seqs = [seq for seq, r in zip(seqs, new) if r in drafted]
            calls.append(self.engines.add_to_drafter(draft_seqs))
        self.early_tokens.start(r.request_id for r in new)
        try:
            results = await asyncio.gather(*calls, return_exceptions=True)
            if is_drafting and isinstance(results[1], Exception):
                self._lose_drafter(results[1])
            elif is_drafting:  # a request the drafter refused runs undrafted (coordinator.fallback)
                self.drafter_link.refuse(results[1])
                for request in drafted:
                    if request.request_id not in results[1]:
                        request.num_drafter_tokens = len(request.prompt_token_ids)
            self._start_requests(new, results[0])
        finally:   # whatever happened (cancelled at shutdown, too), nothing more is held for them
            for request in new:
                self.early_tokens.take(request.request_id)

    def _start_requests(self, new: list[RequestState], outputs: dict[str, object]) -> None:
        """Stream each first token (TTFT), then what a running call streamed of the request
        meanwhile (``EarlyTokens``), and place the survivors in the Batch Manager."""
        alive = []
        for request in new:
            out, early = outputs.get(request.request_id), self.early_tokens.take(request.request_id)
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while prefilling; its release is queued
            if isinstance(out, grpc.aio.AioRpcError):
                self._retire(request, None, error=(out.code(), f"verifier prefill failed: {out.details()}"))
            elif out is None or len(out.token_ids) != 1:
                self._retire(request, None, error=(grpc.StatusCode.INTERNAL, "verifier returned "
                                                   f"{0 if out is None else len(out.token_ids)} first tokens, not 1"))
            elif all(self._commit_output(request, o) for o in (out, *early)):   # stops at a finish
                alive.append(request.request_id)
        if self.cfg.uses_batches:
            self.balancer.assign(self.batches, alive, self._cost_of, self.cfg.max_num_seqs)

    def _num_to_admit(self, num_free: int) -> int:
        """Requests to admit from the queue's head now (the balancer may hold some one step)."""
        num = max(min(num_free, len(self.waiting)), 0)
        head = [request for request, _ in zip(self.waiting.values(), range(num))]
        # an id aborted and reused before its KV release ran waits for the next sync (FIFO: and those behind it)
        head = head[:next((i for i, r in enumerate(head) if r.request_id in self._to_release), len(head))]
        num = num_within_token_budget([len(r.prompt_token_ids) for r in head], self.cfg.max_num_batched_tokens)
        head = head[:num]
        if not self.cfg.uses_batches or num == 0 or self.effective_mode != Mode.PSD:
            return num
        positions = self.chooser.max_k + 1
        costs = [self.balancer.request_cost(positions, len(r.prompt_token_ids)) for r in head]
        admitted = self.balancer.num_to_admit(self.batches, costs, self.cfg.max_num_seqs, self._cost_of,
                                              self._is_head_held)
        self._is_head_held = admitted < num
        return admitted
