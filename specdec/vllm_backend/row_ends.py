"""Where each row of a multi-step decode call ends (``VllmTargetWorker._run``; no torch).

A row of ``decode`` runs its quota of sampling steps (``PsdStep.quota``: the call's steps, or
its cap: the tokens it has left before ``max_tokens``), unless it samples one of its stop tokens
first (``SamplingParams.stop_token_set``: its stop token ids, EOS unless ``ignore_eos``; the
coordinator's finish rule): then its part in the call ends after that step (``PsdScheduler.stop``),
so the call neither decodes past the request's end nor holds its last tokens back until the
call's other rows are done. Under async scheduling the row's next step may be scheduled already,
one token more, which the coordinator drops as it drops anything past a finish.
"""

from __future__ import annotations


class RowEnds:
    """The rows of one call: their quotas (from the scheduler's current step), stop tokens,
    and which ended at each engine step.

    Args:
        scheduler: the engine's ``PsdScheduler`` running the call (its ``psd_step`` set).
        eos_token_ids: the target model's EOS ids.
    """

    def __init__(self, scheduler, eos_token_ids) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = tuple(eos_token_ids)
        self._vllm_ids: dict[str, str] = {}        # request id -> vLLM id of every watched row
        self._stop_sets: dict[str, frozenset[int]] = {}
        self._stopped: set[str] = set()

    def add(self, residents: dict) -> None:
        """Watch {request id: resident state (``vllm_id``, ``params``)}: each row's quota and stop tokens."""
        for rid, state in residents.items():
            self._vllm_ids[rid] = state.vllm_id
            self._stop_sets[rid] = state.params.stop_token_set(self.eos_token_ids)

    def quota(self, vllm_id: str) -> int:
        """Sampling steps ``vllm_id`` runs in the call now (``stop`` lowers it)."""
        return self.scheduler.psd_step.quota(vllm_id)

    def is_done(self, vllm_id: str, delta) -> bool:
        """Whether the row's merged ``StepDelta`` (None: no output yet) has all its call's steps."""
        return delta is not None and (delta.num_steps >= self.quota(vllm_id) or delta.finish_reason is not None)

    def all_done(self, merged: dict) -> bool:
        """Whether every watched row (a multi-step call's named and joined rows) has all its steps."""
        return all(self.is_done(vllm_id, merged.get(rid)) for rid, vllm_id in self._vllm_ids.items())

    def after_step(self, outputs: dict, merged: dict) -> set[str]:
        """After an engine step ({request id: ``CoreOutput``}; ``merged``: the
        call's ``StepDelta``s so far): stop the rows that sampled a stop token, and return the ids
        whose part in the call ended with this step before the call's last step (stopped, at a
        cap below the call's steps, or at the context window)."""
        ended, step = set(), self.scheduler.psd_step
        for rid, output in outputs.items():
            vllm_id = self._vllm_ids.get(rid)
            if vllm_id is None:
                continue
            stops = self._stop_sets[rid]
            if rid not in self._stopped and stops and not stops.isdisjoint(output.token_ids):
                self._stopped.add(rid)
                self.scheduler.stop(vllm_id)
                ended.add(rid)
                continue
            delta, quota = merged.get(rid), step.quota(vllm_id)   # one quota look-up per row and step
            if delta is not None and (delta.finish_reason is not None
                                      or (delta.num_steps >= quota and quota < step.num_steps)):
                ended.add(rid)
        return ended

    def steps_left(self, vllm_ids, by_vllm_id: dict[str, str], merged: dict) -> int:
        """Steps the call still runs for its rows ``vllm_ids`` (what a request joining now may decode)."""
        return max((self.quota(v) - (merged[rid].num_steps if (rid := by_vllm_id.get(v)) in merged else 0)
                    for v in vllm_ids if not self.is_done(v, merged.get(by_vllm_id.get(v)))), default=0)
