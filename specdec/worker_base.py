"""Request bookkeeping shared by the engine workers (``specdec.worker``, ``specdec.draft_worker``):
step outputs, per-request state and generators, slot allocation with prefill, release.

Randomness: each request owns one generator per worker, seeded from ``params.seed`` (the draft
worker derives a distinct seed from it) or, when unseeded, from a worker-level seed source drawn
at ``add_request`` time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from specdec.errors import CapacityError
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, make_generator

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
    (same log-softmax, most likely first); empty when ``params.logprobs`` is 0.
    """

    request_id: str
    token_ids: list[int]
    num_accepted: int
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)


def top_logprobs(logprobs: torch.Tensor, num_top: int) -> list[tuple[list[int], list[float]]]:
    """Per row of ``logprobs`` [t, V], the ``num_top`` most likely (token ids, logprobs),
    most likely first; ``[]`` when ``num_top`` is 0."""
    if num_top <= 0:
        return []
    values, indices = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return list(zip(indices.tolist(), values.tolist()))


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
    committed: list[int] = field(default_factory=list)           # draft only
    kv_token_ids: list[int] = field(default_factory=list)        # draft only


def _draft_seed(seed: int) -> int:
    return (seed * _DRAFT_SEED_MULTIPLIER + 1) % (1 << _SEED_BITS)


class Worker:
    """Request bookkeeping shared by both workers."""

    def __init__(self, runner: ModelRunner, seed: int | None) -> None:
        self.runner = runner
        self._seed_source = random.Random(seed)
        self._requests: dict[str, RequestState] = {}

    def _new_state(self, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, is_draft: bool) -> tuple[RequestState, torch.Tensor]:
        """Allocate a slot, prefill the prompt; return the state and last-token logits [1, V]."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already active")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must be non-empty")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(_SEED_BITS)
        generator = make_generator(_draft_seed(seed) if is_draft else seed)
        slot = self.runner.allocate_slot()
        try:
            logits = self.runner.prefill([slot], [list(prompt_token_ids)])
        except Exception:
            self.runner.free_slot(slot)
            raise
        state = RequestState(slot=slot, params=params, generator=generator)
        self._requests[request_id] = state
        return state, logits

    def _states(self, request_ids: list[str]) -> list[RequestState]:
        missing = [r for r in request_ids if r not in self._requests]
        if missing:
            raise KeyError(f"unknown request ids: {missing}")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids must be distinct, got {request_ids}")
        return [self._requests[r] for r in request_ids]

    def release(self, request_id: str) -> None:
        """Free the request's KV slot. Raises KeyError if the request is not active."""
        self.runner.free_slot(self._requests.pop(request_id).slot)

    @property
    def num_active(self) -> int:
        """Number of requests holding a slot."""
        return len(self._requests)
