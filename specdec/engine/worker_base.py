"""Request bookkeeping shared by the engine workers (``specdec.engine.worker``, ``specdec.engine.draft_worker``):
step outputs, per-request state and generators, slot allocation with prefill, release.

Randomness: each request owns one generator per worker, seeded from ``params.seed`` (the draft
worker derives a distinct seed from it) or, when unseeded, from a worker-level seed source drawn
at ``add_request`` time.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from opentelemetry import trace

from specdec.engine_api import EngineFacts, runner_facts
from specdec.errors import CapacityError
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams, make_generator

# Child spans of the engine services' RPC spans (no-op unless minedraft.telemetry is on).
tracer = trace.get_tracer("minedraft.specdec")

_SEED_BITS = 63
_DRAFT_SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # golden-ratio constant: decorrelates draft seeds


@dataclass
class StepOutput:
    """Tokens committed for one request by ``add_request`` (1 token) or ``verify`` (a + 1).

    ``logprobs[i]`` is the target model's own log-probability of ``token_ids[i]``: log-softmax of
    the raw logits (temperature 1, no top-k/top-p/min-p), natural log. ``top_logprobs[i]`` is
    ``(token ids, logprobs)`` of the ``params.logprobs`` most likely tokens at that position
    (same log-softmax, most likely first); empty when ``params.logprobs`` is 0. Both are empty
    when ``params.logprobs`` is ``NO_LOGPROBS`` (-1). ``is_final`` (a multi-step ``decode``'s
    per-step outputs only): the row stops before the call's last step (its step cap, a stop
    token, or the context window); the call decodes no more tokens for it.
    """

    request_id: str
    token_ids: list[int]
    num_accepted: int
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    is_final: bool = False


def top_logprobs(logprobs: torch.Tensor, num_top: int) -> list[tuple[list[int], list[float]]]:
    """Per row of ``logprobs`` [t, V], the ``num_top`` most likely (token ids, logprobs),
    most likely first; ``[]`` when ``num_top`` is 0."""
    if num_top <= 0:
        return []
    values, indices = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return list(zip(indices.tolist(), values.tolist()))


def decode_steps(worker, request_ids: list[str], num_steps: int, on_step=None,
                 max_steps: list[int] | None = None) -> list[StepOutput]:
    """``num_steps`` plain decode steps (``worker.verify`` with k = 0) of ``request_ids``, merged
    into one ``StepOutput`` per request (multi-step decoding: one engine call for several
    tokens). A row stops early at its cap (``max_steps[i]``: the tokens it has left) or after a
    step that samples one of its stop tokens (``SamplingParams.stop_token_set``); the other rows
    go on. A step that hits the context window after the first stops the loop (it changes no
    state), so every row still running then has the same, smaller, number of tokens.

    ``on_step``: called after each step with that step's ``StepOutput``s (one token per row
    that ran it; ``is_final`` on the last of a row that stops before the call's last step), in
    the calling thread, before the next step runs (streamed multi-step decoding).

    Raises:
        ValueError: ``num_steps`` < 1, or ``max_steps`` not one cap >= 1 per row; otherwise as
            ``worker.verify`` (first step only).
    """
    caps = decode_step_caps(num_steps, max_steps, len(request_ids))
    eos = worker.facts().eos_token_ids
    stops = [state.params.stop_token_set(eos) for state in worker._states(request_ids)]
    merged: list[StepOutput | None] = [None] * len(request_ids)
    running = list(range(len(request_ids)))
    for step_index in range(num_steps):
        if not running:
            break
        try:
            step = worker.verify([request_ids[i] for i in running], [[] for _ in running], None)
        except CapacityError:
            if step_index == 0:
                raise
            break
        for i, out in zip(running, step):   # final: the row stops before the call's last step
            out.is_final = step_index + 1 >= caps[i] < num_steps or not stops[i].isdisjoint(out.token_ids)
            if merged[i] is None:
                merged[i] = replace(out, token_ids=list(out.token_ids), logprobs=list(out.logprobs),
                                    top_logprobs=list(out.top_logprobs), is_final=False)
            else:
                merged[i].token_ids += out.token_ids
                merged[i].logprobs += out.logprobs
                merged[i].top_logprobs += out.top_logprobs
        if on_step is not None:
            on_step(step)
        running = [i for i, out in zip(running, step) if not out.is_final and step_index + 1 < caps[i]]
    return merged


def decode_step_caps(num_steps: int, max_steps: list[int] | None, num_rows: int) -> list[int]:
    """Each row's decode steps in a ``num_steps`` call: ``min(num_steps, max_steps[i])``, or
    ``num_steps`` for every row when ``max_steps`` is None or empty.

    Raises:
        ValueError: ``num_steps`` < 1, or ``max_steps`` is not one int >= 1 per row.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
    if not max_steps:
        return [num_steps] * num_rows
    if len(max_steps) != num_rows or any(int(n) < 1 for n in max_steps):
        raise ValueError(f"max_decode_steps: one cap >= 1 per row ({num_rows}), got {list(max_steps)}")
    return [min(num_steps, int(n)) for n in max_steps]


class DraftCapacityError(CapacityError):
    """Drafting would push some requests past the draft model's ``max_model_len``.

    Raised by :meth:`DraftWorker.draft` before any state changes; ``request_ids`` lists the
    offenders. Callers verify those requests without speculation (k = 0) from then on.
    """

    def __init__(self, request_ids: list[str], max_model_len: int) -> None:
        super().__init__(f"requests {request_ids} would exceed the draft max_model_len="
                         f"{max_model_len}; run them without speculation")
        self.request_ids = request_ids


@dataclass
class RequestState:
    slot: int
    params: SamplingParams
    generator: torch.Generator
    pending_token_id: int = -1                                  # target only
    committed: list[int] = field(default_factory=list)           # draft; target with penalties
    num_prompt_tokens: int = 0                                   # of committed: the prompt
    kv_token_ids: list[int] = field(default_factory=list)        # draft only


def penalty_history(state: RequestState, drafted: list[int] = ()) -> tuple[list[int], list[int]] | None:
    """(prompt, output so far + ``drafted``) of a request with penalties (``specdec.sample.penalties``),
    from its committed tokens; None without penalties."""
    if not state.params.has_penalties:
        return None
    split = state.num_prompt_tokens
    return state.committed[:split], state.committed[split:] + list(drafted)


def prefill_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of prompts of ``lengths`` grouped for batched prefill: shortest first, each group
    as many prompts as keep ``len(group) * longest`` within ``max_tokens`` (padded tokens); a
    prompt longer than ``max_tokens`` forms its own group; ``max_tokens`` 0: one per group."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _draft_seed(seed: int) -> int:
    return (seed * _DRAFT_SEED_MULTIPLIER + 1) % (1 << _SEED_BITS)


class Worker:
    """Request bookkeeping shared by both workers."""

    def __init__(self, runner: ModelRunner, seed: int | None) -> None:
        self.runner = runner
        self._seed_source = random.Random(seed)
        self._requests: dict[str, RequestState] = {}

    def _new_states(self, items: list[tuple[str, list[int], SamplingParams]],
                    is_draft: bool) -> list[tuple[RequestState, torch.Tensor]]:
        """Allocate a slot per ``(request_id, prompt_token_ids, params)`` and prefill the prompts,
        several per forward (``prefill_groups``); return each request's state and last-token
        logits ``[V]`` in ``items`` order. All or nothing: on any error no request is added and
        every slot taken here is freed.

        Raises:
            ValueError: a duplicate or already active id, an empty prompt (nothing allocated).
            CapacityError: no free slot, or a prompt too long for ``max_model_len``.
        """
        ids = [request_id for request_id, _, _ in items]
        counts = Counter(ids)
        duplicates = sorted(r for r, n in counts.items() if n > 1 or r in self._requests)
        if duplicates:
            raise ValueError(f"request ids are already active or repeated: {duplicates}")
        if any(not prompt for _, prompt, _ in items):
            raise ValueError("prompt_token_ids must be non-empty")
        seeds = [p.seed if p.seed is not None else self._seed_source.getrandbits(_SEED_BITS) for _, _, p in items]
        generators = [make_generator(_draft_seed(seed) if is_draft else seed) for seed in seeds]
        slots: list[int] = []
        try:
            for _ in items:
                slots.append(self.runner.allocate_slot())
            logits: list[torch.Tensor | None] = [None] * len(items)
            budget = self.runner.prefill_token_budget
            for group in prefill_groups([len(prompt) for _, prompt, _ in items], budget):
                rows = self.runner.prefill([slots[i] for i in group], [list(items[i][1]) for i in group])
                for row, i in enumerate(group):
                    logits[i] = rows[row]                                   # [V]
        except Exception:
            for slot in slots:
                self.runner.free_slot(slot)
            raise
        out = []
        for (request_id, _, params), slot, generator, row_logits in zip(items, slots, generators, logits):
            state = RequestState(slot=slot, params=params, generator=generator)
            self._requests[request_id] = state
            out.append((state, row_logits))
        return out

    def _states(self, request_ids: list[str]) -> list[RequestState]:
        missing = [r for r in request_ids if r not in self._requests]
        if missing:
            raise KeyError(f"unknown request ids: {missing}")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids must be distinct, got {request_ids}")
        return [self._requests[r] for r in request_ids]

    def facts(self) -> EngineFacts:
        """What ``EngineInfo`` reports of this worker's engine (``specdec.engine_api``)."""
        return runner_facts(self.runner)

    def release(self, request_id: str) -> None:
        """Free the request's KV slot. Raises KeyError if the request is not active."""
        self.runner.free_slot(self._requests.pop(request_id).slot)

    @property
    def num_active(self) -> int:
        """Number of requests holding a slot."""
        return len(self._requests)
