"""``PsdScheduler``: vLLM's v1 scheduler, restricted to the batch the coordinator names.

Configured through vLLM's documented extension point ``scheduler_config.scheduler_cls``
(``"specdec.vllm_backend.scheduler.PsdScheduler"``); it subclasses ``vllm.v1.core.sched.
scheduler.Scheduler`` and overrides only ``schedule``. No torch, no vLLM file is edited.

PSD (MineDraft, Tang, Verma et al. 2026, §5.1) keeps two batches resident on one target KV
cache and verifies one of them per step while the drafter drafts the other. vLLM's scheduler
would run every running request each step; this one runs only ``step.request_ids``:

- the requests of the named batch are scheduled with the draft tokens the coordinator sent
  (``request.spec_token_ids``), so vLLM verifies exactly those drafts with its own rejection
  sampler (accepted tokens, then one recovered or bonus token) and rolls the KV of rejected
  positions back (``num_computed_tokens``);
- every other running request stays resident and paused: it keeps its KV blocks and is not
  scheduled (vLLM's model runner keeps the cached state of unscheduled requests);
- a waiting (just added) request is scheduled only when it is in the named set (its prefill).

The KV cache is sized at start-up for ``max_num_seqs x max_model_len`` tokens
(``specdec.vllm_backend.engine``), so a step never preempts; a preemption would drop a paused
request's KV, and raises ``RuntimeError`` instead of passing silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.sched.scheduler import Scheduler


@dataclass(frozen=True)
class PsdStep:
    """What the next ``schedule()`` runs.

    Attributes:
        request_ids: vLLM (internal) request ids allowed to run; every other request is paused.
        draft_token_ids: per request id, the draft tokens to verify (``[k_i]`` ids; absent or
            empty: plain decode or prefill).
    """

    request_ids: frozenset[str]
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


class PsdScheduler(Scheduler):
    """vLLM's scheduler with a per-step request filter and externally given draft tokens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.psd_step: PsdStep | None = None  # None: plain vLLM scheduling (every request runs)

    def set_step(self, step: PsdStep | None) -> None:
        """Run only ``step`` from the next ``schedule()`` on (None: every request)."""
        self.psd_step = step

    def schedule(self, *args, **kwargs):
        step = self.psd_step
        if step is None:
            return super().schedule(*args, **kwargs)
        stray = [r.request_id for r in self.waiting if r.request_id not in step.request_ids]
        if stray:
            raise RuntimeError(f"waiting requests outside the scheduled batch: {stray}")
        paused = [r for r in self.running if r.request_id not in step.request_ids]
        self.running = [r for r in self.running if r.request_id in step.request_ids]
        for request in self.running:
            request.spec_token_ids = list(step.draft_token_ids.get(request.request_id, ()))
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.running = self.running + paused
        if output.preempted_req_ids:
            raise RuntimeError(f"vLLM preempted {sorted(output.preempted_req_ids)}: the KV cache is too small "
                               "for the resident requests")
        return output
