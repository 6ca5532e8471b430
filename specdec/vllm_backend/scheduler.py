"""``PsdScheduler``: vLLM's v1 scheduler, restricted to the batch the coordinator names.

Configured through vLLM's documented extension point ``scheduler_config.scheduler_cls``
(``"specdec.vllm_backend.scheduler.PsdScheduler"``, or ``PsdAsyncScheduler`` for an engine with
vLLM's async scheduling); it subclasses ``vllm.v1.core.sched.scheduler.Scheduler`` (or its
``AsyncScheduler``) and overrides only ``schedule``. No torch, no vLLM file is edited.

PSD (MineDraft, Tang, Verma et al. 2026, §5.1) keeps two batches resident on one target KV
cache and verifies one of them per step while the drafter drafts the other. vLLM's scheduler
would run every running request each step; this one runs only ``step.request_ids``:

- the requests of the named batch are scheduled with the draft tokens the coordinator sent
  (``request.spec_token_ids``), so vLLM verifies exactly those drafts with its own rejection
  sampler (accepted tokens, then one recovered or bonus token) and rolls the KV of rejected
  positions back (``num_computed_tokens``);
- each named request is scheduled for at most ``step.num_steps`` sampling steps (a step that
  ends its prompt, or any step after that), then paused again; so a multi-step decode
  (``num_steps`` > 1, plain decoding only) runs exactly that many tokens, also under async
  scheduling, where vLLM schedules step i + 1 while step i runs on the GPU;
- every other running request stays resident and paused: it keeps its KV blocks and is not
  scheduled (vLLM's model runner keeps the cached state of unscheduled requests);
- a waiting (just added) request is scheduled only when it is in the named set (its prefill);
  ``join`` names more requests during a multi-step call (``specdec.vllm_backend.joining``):
  their prefill runs beside the decode rows' next step, then they decode with them.

The drafter's resident draft sessions (``specdec.vllm_backend.draft_sessions``) are vLLM's
resumable requests ("streaming input" sessions: a request that, once it has sampled its
``max_tokens``, waits with its KV blocks for its next input chunk); ``resume_session`` first rolls
one back to the tokens the verifier kept, then hands it its next chunk.

The KV cache is sized at start-up for ``max_num_seqs x max_model_len`` tokens
(``specdec.vllm_backend.engine``), so a step never preempts; a preemption would drop a paused
request's KV, and raises ``RuntimeError`` instead of passing silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus, StreamingUpdate


@dataclass(frozen=True)
class PsdStep:
    """What the next ``schedule()`` calls run.

    Attributes:
        request_ids: vLLM (internal) request ids allowed to run; every other request is paused.
        draft_token_ids: per request id, the draft tokens to verify (``[k_i]`` ids; absent or
            empty: plain decode or prefill).
        num_steps: sampling steps each named request may be scheduled for (>= 1; > 1 only for
            plain decoding: the draft tokens go with the first step only).
        num_steps_of: per request id, its own ``num_steps`` (requests that joined the call: 1).

    Raises:
        ValueError: ``num_steps`` < 1, or > 1 with draft tokens.
    """

    request_ids: frozenset[str]
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_steps: int = 1
    num_steps_of: dict[str, int] = field(default_factory=dict)

    def quota(self, request_id: str) -> int:
        """Sampling steps ``request_id`` may run in this step."""
        return self.num_steps_of.get(request_id, self.num_steps)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {self.num_steps}")
        if self.num_steps > 1 and any(self.draft_token_ids.values()):
            raise ValueError("num_steps: > 1 only for plain decoding (no draft tokens)")


class PsdSchedulerMixin:
    """The per-step request filter and externally given draft tokens (see module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.psd_step: PsdStep | None = None  # None: plain vLLM scheduling (every request runs)
        self.num_sampling_steps: dict[str, int] = {}  # per named request, in the current step

    def set_step(self, step: PsdStep | None) -> None:
        """Run only ``step`` from the next ``schedule()`` on (None: every request)."""
        self.psd_step = step
        self.num_sampling_steps = {}

    def join(self, quotas: dict[str, int]) -> None:
        """Name the requests of ``quotas`` too, each for its own number of sampling steps (the
        first: its prefill), keeping the steps the current ones have run. Raises RuntimeError
        outside a named step."""
        if self.psd_step is None:
            raise RuntimeError("join: no named step to join")
        step = self.psd_step
        self.psd_step = replace(step, request_ids=step.request_ids | frozenset(quotas),
                                num_steps_of={**step.num_steps_of, **quotas})

    def stop(self, request_id: str) -> None:
        """End ``request_id``'s part in the current step after the sampling steps scheduled for
        it so far (it sampled a stop token). Raises RuntimeError outside a named step."""
        if self.psd_step is None:
            raise RuntimeError("stop: no named step")
        step = self.psd_step
        self.psd_step = replace(step, num_steps_of={**step.num_steps_of,
                                                    request_id: self.num_sampling_steps.get(request_id, 0)})

    def resume_session(self, request_id: str, num_kept: int, new_token_ids: list[int], max_tokens: int,
                       sampling_params) -> None:
        """Resume the resumable request ``request_id`` (waiting for its next input chunk): keep
        its first ``num_kept`` tokens and their KV, drop the rest (draft tokens the verifier
        rejected; their KV slots are written again), append ``new_token_ids`` and sample
        ``max_tokens`` tokens with ``sampling_params``. vLLM's own session update
        (``_update_request_as_session``) keeps every computed token; the roll-back before it is
        ours. Needs prefix caching off (a kept block's rewritten slots must not be shared).

        Raises:
            RuntimeError: the request is not waiting for input. ValueError: ``num_kept`` is
                outside [0, computed tokens], or no new token (a chunk must compute one).
        """
        request = self.requests[request_id]
        if request.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            raise RuntimeError(f"draft session {request_id!r} is {request.status.name}, not waiting for input")
        if not 0 <= num_kept <= request.num_computed_tokens or not new_token_ids:
            raise ValueError(f"num_kept {num_kept} outside [0, {request.num_computed_tokens}] or no new token")
        del request._all_token_ids[num_kept:]
        if num_kept < request.num_prompt_tokens:
            del request.prompt_token_ids[num_kept:]
            request.num_prompt_tokens = num_kept
        request.num_computed_tokens = num_kept
        request.max_tokens = max_tokens   # vLLM 0.24's session update keeps the first chunk's
        self._update_request_as_session(request, StreamingUpdate(
            mm_features=None, prompt_token_ids=list(new_token_ids), max_tokens=max_tokens, arrival_time=time.time(),
            sampling_params=sampling_params))

    def schedule(self, *args, **kwargs):
        step = self.psd_step
        if step is None:
            return super().schedule(*args, **kwargs)
        stray = [r.request_id for r in self.waiting if r.request_id not in step.request_ids]
        if stray:
            raise RuntimeError(f"waiting requests outside the scheduled batch: {stray}")
        done, named, drafts = self.num_sampling_steps, step.request_ids, step.draft_token_ids
        running, paused = [], []
        for request in self.running:   # one pass: the named requests with steps left run
            rid = request.request_id
            num_done = done.get(rid, 0)
            if rid in named and num_done < step.quota(rid):
                running.append(request)   # the drafts go with a request's first sampling step
                request.spec_token_ids = list(drafts.get(rid, ())) if num_done == 0 and drafts else []
            else:
                paused.append(request)
        self.running = running
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.running = self.running + paused
        if output.preempted_req_ids:
            raise RuntimeError(f"vLLM preempted {sorted(output.preempted_req_ids)}: the KV cache is too small "
                               "for the resident requests")
        for rid in output.num_scheduled_tokens:
            if _samples(self.requests[rid]):
                done[rid] = done.get(rid, 0) + 1   # this step samples a token (not a prompt chunk)
        return output


def _samples(request) -> bool:
    """Whether the step just scheduled for ``request`` samples a token: its prompt is computed
    once the step's tokens are (vLLM's ``schedule`` has advanced ``num_computed_tokens`` by them,
    prefix-cache hits included: a waiting request's hits are not counted before ``schedule``)."""
    return request.num_computed_tokens >= request.num_prompt_tokens


class PsdScheduler(PsdSchedulerMixin, Scheduler):
    """vLLM's (synchronous) scheduler with the PSD step filter."""


class PsdAsyncScheduler(PsdSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler (``async_scheduling=True``) with the PSD step filter: a multi-step
    decode overlaps scheduling step i + 1 with running step i."""
