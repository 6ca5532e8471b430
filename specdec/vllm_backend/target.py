"""``VllmTargetWorker``: the target model on vLLM, behind the verifier's engine seam.

The same contract as ``specdec.engine.worker.TargetWorker`` (``specdec.engine_api.TargetEngine``):
``add_requests`` prefills prompts and samples their first token, ``verify`` scores a named
batch's draft tokens and commits the accepted tokens plus one recovered or bonus token,
``release`` frees a request. Underneath, each request is one vLLM request kept resident for its
whole life (``ignore_eos``, ``max_tokens`` up to the context window; the coordinator finishes it
and releases it), and each call runs one ``PsdScheduler`` step on exactly the named requests:

- accepted / recovered / bonus tokens are vLLM's (``vllm.v1.sample.rejection_sampler``):
  accept draft d_i with probability min(1, p(d_i)/q(d_i)); without draft probabilities (our
  case: vLLM's ``custom_class`` proposers pass none) q is the one-hot of d_i, i.e. accept with
  probability p(d_i) and on rejection sample from p with d_i removed and renormalised, which is
  lossless for any proposal (Leviathan et al. 2023, Theorem 1; DESIGN.md §9);
- KV rollback past rejected positions is vLLM's (``num_computed_tokens``);
- draft probabilities sent by the drafter are not needed and are ignored;
- a request added while a multi-step ``decode`` call runs joins that call
  (``join_running_call``, ``specdec.vllm_backend.joining``): prefilled between two of its steps,
  as vLLM's continuous batching admits requests, with its first token returned at once; it
  decodes with the call's rows for their remaining steps, and the call returns those tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.engine.worker_base import decode_step_caps
from specdec.engine_api import EngineFacts
from specdec.errors import CapacityError
from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.bookkeeping import check_new_ids, known_states
from specdec.vllm_backend.engine import (VllmEngineConfig, build_engine, refusals_as_value_errors, scheduler_of,
                                         to_vllm_sampling)
from specdec.vllm_backend.joining import CallJoins, JoiningCallsMixin
from specdec.vllm_backend.outputs import CoreTime, StepDelta, core_step, engine_facts, step_output, streamer
from specdec.vllm_backend.row_ends import RowEnds
from specdec.vllm_backend.scheduler import PsdStep

MAX_PREFILL_STEPS = 64   # chunked prefill: steps until every new prompt has its first token


@dataclass
class _Resident:
    vllm_id: str
    params: SamplingParams
    is_finished: bool = False   # vLLM ended it (context window); only release remains


class VllmTargetWorker(JoiningCallsMixin):
    """Target-model worker on an in-process vLLM engine (see module docstring).

    Args:
        cfg: the engine settings (``num_speculative_tokens`` >= the largest k ever verified).
        engine: an engine built from ``cfg`` (tests share one); None builds it.
    """

    def __init__(self, cfg: VllmEngineConfig, engine=None) -> None:
        self.cfg = cfg
        self.engine = engine if engine is not None else build_engine(cfg)
        self.scheduler = scheduler_of(self.engine)
        self.scheduler.set_step(PsdStep(frozenset()))   # between calls nothing may run
        self._requests: dict[str, _Resident] = {}
        self._names: dict[str, tuple[str, int]] = {}   # vLLM's id -> (ours, top logprobs asked): core_step
        self._facts = engine_facts(self.engine, cfg)
        self._joins = CallJoins()  # requests joining a running multi-step call
        self.last_call = CoreTime()   # the last verify / decode call's time in vLLM's engine core

    def facts(self) -> EngineFacts:
        return self._facts.with_free_slots(self.cfg.max_num_seqs - len(self._requests))

    @property
    def max_num_draft_tokens(self) -> int:
        """The largest k_i ``verify`` takes (the engine's ``num_speculative_tokens``)."""
        return self.cfg.num_speculative_tokens

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def add_requests(self, items: list[tuple[str, list[int], SamplingParams]]):
        """Prefill every prompt and sample its first token; all requests or none.

        Args:
            items: (request id, prompt token ids, sampling params with a seed) per request.

        Returns:
            One ``StepOutput`` per item (1 token, ``num_accepted`` 0), in order.

        Raises:
            ValueError: a repeated or already active id, an empty prompt, a token id out of range,
                or sampling parameters vLLM refuses (e.g. temperature > 2; min_p with speculation).
            CapacityError: no free slot, or a prompt that leaves no room in ``max_model_len``.
        """
        added = self._add_to_engine(items)
        return self._first_tokens(items, added, self._prefill(added))

    def join_running_call(self, items: list[tuple[str, list[int], SamplingParams]]):
        """Any thread: hand ``items`` (as for ``add_requests``) to the multi-step ``decode`` call
        now running, which prefills them between two of its steps (``specdec.vllm_backend.joining``).

        Returns:
            A ``concurrent.futures.Future`` of their ``StepOutput``s (its exception: what
            ``add_requests`` raises), or None when no call is running (call ``add_requests``).
        """
        return self._joins.submit(items)

    def _add_to_engine(self, items) -> dict[str, _Resident]:
        """Check ``items`` and add them to the engine (all or none); resident from now on."""
        ids = [rid for rid, _, _ in items]
        check_new_ids(self._requests, ids, self.cfg.max_num_seqs)
        for rid, prompt, _ in items:
            self._check_prompt(rid, prompt)
        added = {}
        try:
            for rid, prompt, params in items:
                with refusals_as_value_errors():
                    vllm_id = self.engine.add_request(rid, {"prompt_token_ids": list(prompt)},
                                                      to_vllm_sampling(params, self.cfg.max_model_len - len(prompt)))
                added[rid] = _Resident(vllm_id, params)
        except BaseException:  # e.g. vLLM refused a sampling parameter: the others of the call go too
            if added:
                self.engine.abort_request([state.vllm_id for state in added.values()], internal=True)
            raise
        self._requests.update(added)
        self._names.update({state.vllm_id: (rid, state.params.logprobs) for rid, state in added.items()})
        return added

    @staticmethod
    def _first_tokens(items, added: dict[str, _Resident], outputs: dict) -> list:
        """Each new request's first token (a joined request may have decoded more meanwhile: the
        call returns those, ``StepDelta.after_first``)."""
        return [step_output(rid, outputs[rid].first(), 0, added[rid].params.logprobs) for rid, _, _ in items]

    def _check_prompt(self, request_id: str, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError(f"prompt_token_ids of {request_id!r} must not be empty")
        if len(prompt) >= self.cfg.max_model_len:
            raise CapacityError(f"prompt of {request_id!r} has {len(prompt)} tokens; max_model_len is "
                                f"{self.cfg.max_model_len}")
        bad = [t for t in prompt if not 0 <= t < self._facts.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids of {request_id!r} must lie in [0, {self._facts.vocab_size}), got {bad[:8]}")

    def _prefill(self, added: dict[str, _Resident]) -> dict:
        """Step the new requests alone until each has its first token (chunked prefill may take
        several steps); on failure they are aborted again (all or nothing)."""
        try:
            step = self._run(PsdStep(frozenset(s.vllm_id for s in added.values())))
            missing = [rid for rid in added if rid not in step or not step[rid].token_ids]
            if missing:
                raise RuntimeError(f"prefill of {missing} gave no token")
            return step
        except BaseException:
            for rid in added:
                self.release(rid)
            raise

    def verify(self, request_ids: list[str], draft_token_ids: list[list[int]], draft_probs=None, num_steps: int = 1,
               on_step=None, max_steps: list[int] | None = None):
        """One target step over ``request_ids``: row i verifies its k_i = ``len(draft_token_ids[i])``
        draft tokens (0: plain decode) in one forward of k_i + 1 positions.

        Args:
            request_ids: b resident requests (the batch the coordinator names; others stay paused).
            draft_token_ids: b rows of draft token ids, row i of length k_i <= ``num_speculative_tokens``.
            draft_probs: ignored (see the module docstring); accepted for the seam's signature.
            num_steps: plain decode steps in this call (> 1: every row without drafts; ``decode``).
            on_step: ``decode``'s (called after each engine step with the named rows' new tokens).
            max_steps: ``decode``'s per-row caps (None: ``num_steps`` each).

        Returns:
            b ``StepOutput``s of ``num_accepted + 1`` tokens each, in order; then, after a
            multi-step call, one per request that joined it and decoded past its first token
            (``join_running_call``: the tokens after the first, which its join returned).

        Raises:
            KeyError: an unknown request id. ValueError: rows and ids differ in number, a row
            longer than ``num_speculative_tokens``. RuntimeError: the engine did not run a row.
        """
        states = known_states(self._requests, request_ids)
        if len(draft_token_ids) != len(states):
            raise ValueError(f"draft_token_ids has {len(draft_token_ids)} rows for {len(states)} requests")
        too_long = [len(row) for row in draft_token_ids if len(row) > self.cfg.num_speculative_tokens]
        if too_long:
            raise ValueError(f"draft_token_ids rows of {too_long} tokens exceed the engine's "
                             f"num_speculative_tokens={self.cfg.num_speculative_tokens}")
        finished = [rid for rid, s in zip(request_ids, states) if s.is_finished]
        if finished:
            raise CapacityError(f"requests {finished} reached max_model_len={self.cfg.max_model_len}")
        caps = decode_step_caps(num_steps, max_steps, len(states))
        step = PsdStep(frozenset(s.vllm_id for s in states),
                       {s.vllm_id: list(row) for s, row in zip(states, draft_token_ids) if row}, num_steps,
                       {s.vllm_id: cap for s, cap in zip(states, caps) if cap < num_steps})
        outputs = self._run(step, None if on_step is None else streamer(
            [(rid, self._requests[rid].params.logprobs) for rid in request_ids], on_step, self._num_top_of))
        missing = [rid for rid in request_ids if rid not in outputs]
        if missing:
            raise RuntimeError(f"vLLM did not run {missing} in this step")
        named = set(request_ids)
        joined = [step_output(rid, delta.after_first(), 0, self._requests[rid].params.logprobs)
                  for rid, delta in outputs.items()
                  if rid not in named and rid in self._requests and len(delta.token_ids) > 1]
        return [step_output(rid, outputs[rid], len(row), s.params.logprobs)
                for rid, s, row in zip(request_ids, states, draft_token_ids)] + joined

    def _num_top_of(self, request_id: str) -> int:
        return self._requests[request_id].params.logprobs

    def decode(self, request_ids: list[str], num_steps: int, on_step=None, max_steps: list[int] | None = None):
        """``num_steps`` plain decode steps over ``request_ids`` in one call (multi-step decoding:
        under vLLM's async scheduling, step i + 1 is scheduled while step i runs).

        Args:
            request_ids: b resident requests.
            num_steps: decode steps (>= 1). A row stops early at its cap, after a step that
                samples one of its stop tokens (``SamplingParams.stop_token_set``; under async
                scheduling its next step may be scheduled already: one token more), or at
                ``max_model_len``; the other rows go on.
            on_step: None, or called in this thread after each engine step, before the next is
                scheduled, with the ``StepOutput``s (``num_accepted`` 0) of the named rows that got
                tokens in it, then of the joined rows (their tokens after the first, which their
                join returned): their new tokens only, ``is_final`` on the last of a row that
                stops before the call's last step (streamed multi-step decoding).
            max_steps: None, or per row the most steps it runs (>= 1; the tokens it has left
                before ``max_tokens``).

        Returns:
            b ``StepOutput``s of up to ``num_steps`` tokens each (``num_accepted`` 0), in order,
            then those of the requests that joined the call (see ``verify``).

        Raises:
            KeyError: an unknown request id. ValueError: ``num_steps`` < 1, a cap < 1.
            CapacityError: a row already at ``max_model_len``. RuntimeError: a row did not run.
        """
        return self.verify(request_ids, [[] for _ in request_ids], None, num_steps, on_step, max_steps)

    def _run(self, step: PsdStep, on_engine_step=None) -> dict:
        """Engine steps restricted to ``step`` until every named request has run its
        ``step.num_steps`` sampling steps (or ended): {request id: ``StepDelta``, the merged
        deltas}. Under async scheduling the engine scheduled one more (empty: every quota is
        spent) batch meanwhile; it stays queued and the next call's first step pops it, since a
        queue of resident requests never drains (each step schedules again). A multi-step call
        takes joins (``join_running_call``) until its rows are done, and ends a row's part after
        a step that samples one of its stop tokens (``RowEnds``). ``on_engine_step``: called with
        each engine step's {request id: ``CoreOutput``} and the ids whose part in the
        call that step ended (``outputs.streamer``)."""
        self.scheduler.set_step(step)
        by_vllm_id = {state.vllm_id: rid for rid, state in self._requests.items()}
        merged: dict[str, StepDelta] = {}
        takes_joins, joined = step.num_steps > 1, []
        ends = RowEnds(self.scheduler, self._facts.eos_token_ids)
        if takes_joins:
            ends.add({by_vllm_id[v]: self._requests[by_vllm_id[v]] for v in step.request_ids if v in by_vllm_id})
            self._joins.open()
        # the named rows whose part in the call is not done (ours -> vLLM id): a row's state
        # changes only in a step that gives it output, so only those rows are looked at again
        left = {by_vllm_id.get(v, v): v for v in step.request_ids}
        self.last_call = timed = CoreTime()
        try:
            for _ in range(step.num_steps + MAX_PREFILL_STEPS):
                if takes_joins and left and self._joins.has_pending():
                    joined += self._take_joins(ends.steps_left(step.request_ids, by_vllm_id, merged), ends)
                start = time.perf_counter()
                outputs = core_step(self.engine, self._names)
                timed.add(time.perf_counter() - start)
                for rid, output in outputs.items():
                    merged.setdefault(rid, StepDelta()).add(output)
                final = ends.after_step(outputs, merged)
                if on_engine_step is not None:
                    on_engine_step(outputs, final)
                joined = self._resolve_joins(joined, merged)
                for rid in outputs:
                    if rid in left and ends.is_done(left[rid], merged[rid]):
                        del left[rid]
                if not left and not joined and ends.all_done(merged):
                    break
            else:
                raise RuntimeError(f"vLLM did not finish {step.num_steps} steps in {step.num_steps + MAX_PREFILL_STEPS}")
        except BaseException as exc:
            self._fail_joins(joined + [(join, {}) for join in (self._joins.close() if takes_joins else [])], exc)
            raise
        finally:
            self.scheduler.set_step(PsdStep(frozenset()))
        late = self._joins.close() if takes_joins else []
        for rid, state in self._requests.items():
            delta = merged.get(rid)
            if delta is not None and delta.finish_reason is not None:
                state.is_finished = True
        self._add_late(late)
        return merged

    def release(self, request_id: str) -> None:
        """Abort the vLLM request and free its KV blocks (and its output processor state, which
        ``core_step`` leaves, also once vLLM ended it). Raises KeyError for an unknown id."""
        state = self._requests.pop(request_id)
        self._names.pop(state.vllm_id, None)
        self.engine.abort_request([state.vllm_id], internal=True)

    @property
    def num_active(self) -> int:
        return len(self._requests)


