"""Engine workers: the target model (prefill + verify) and the draft model (catch-up + draft).

Both services wrap these classes, and so do the in-process reference loops
(``specdec.generate``). State contract (docs/ARCHITECTURE.md, "Terms"):

- :class:`TargetWorker`: per request, the KV holds the committed sequence except its last token,
  the *pending token*. A verify step feeds ``[pending, d_1..d_k]``, samples with the rejection
  sampler (Leviathan et al. 2023, Alg. 1), commits ``num_accepted + 1`` tokens and rolls the KV
  back to ``pending + d_1..d_a``. A decode step is a verify step with k = 0.
- :class:`DraftWorker`: per request, the KV holds some token list. ``draft`` first brings it to
  the committed sequence (keep the common prefix, feed the rest: *catch-up*), then runs k
  single-token steps; the KV ends holding ``committed + d_1..d_{k-1}``.

Randomness: each request owns one generator per worker, seeded from ``params.seed`` (the draft
worker derives a distinct seed from it) or, when unseeded, from a worker-level seed source drawn
at ``add_request`` time. Workers built with the same ``seed`` that see the same ``add_request``
order (e.g. tensor-parallel ranks) therefore give every request the same generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from specdec.draft_format import draft_vocab_ids
from specdec.errors import CapacityError
from specdec.fixed_acceptance import FixedAcceptance, fixed_acceptance_sample
from specdec.rejection import rejection_sample
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, logits_to_probs, make_generator, sample_from_probs

# Child spans of the engine services' RPC spans (no-op unless minedraft.telemetry is on).
_tracer = trace.get_tracer("minedraft.specdec")

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
class _RequestState:
    slot: int
    params: SamplingParams
    generator: torch.Generator
    pending_token_id: int = -1                                  # target only
    committed: list[int] = field(default_factory=list)           # draft only
    kv_token_ids: list[int] = field(default_factory=list)        # draft only


def _draft_seed(seed: int) -> int:
    return (seed * _DRAFT_SEED_MULTIPLIER + 1) % (1 << _SEED_BITS)


class _Worker:
    """Request bookkeeping shared by both workers."""

    def __init__(self, runner: ModelRunner, seed: int | None) -> None:
        self.runner = runner
        self._seed_source = random.Random(seed)
        self._requests: dict[str, _RequestState] = {}

    def _new_state(self, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, is_draft: bool) -> tuple[_RequestState, torch.Tensor]:
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
        state = _RequestState(slot=slot, params=params, generator=generator)
        self._requests[request_id] = state
        return state, logits

    def _states(self, request_ids: list[str]) -> list[_RequestState]:
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


class TargetWorker(_Worker):
    """The target model: prefill + first token, then verify steps (k = 0 is plain decode).

    Args:
        runner: the target model's runner (one per worker).
        seed: seeds the source of per-request seeds for unseeded requests (None: random).
        fixed_acceptance: BENCHMARK-ONLY: accept each draft token with a fixed probability
            instead of rejection sampling (``specdec.fixed_acceptance``; changes the output
            distribution). None (default): the exact rejection sampler.
    """

    def __init__(self, runner: ModelRunner, seed: int | None = None,
                 fixed_acceptance: FixedAcceptance | None = None) -> None:
        super().__init__(runner, seed)
        self.fixed_acceptance = fixed_acceptance
        self._bench_generator = None if fixed_acceptance is None else fixed_acceptance.make_generator()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> StepOutput:
        """Prefill the prompt and sample the first output token from the target.

        Raises:
            ValueError: duplicate id or empty prompt. CapacityError: no slot / prompt too long.
        """
        state, logits = self._new_state(request_id, prompt_token_ids, params, is_draft=False)
        probs = logits_to_probs(logits.unsqueeze(1), [params])[:, 0]
        token_id = int(sample_from_probs(probs, [params.is_greedy], [state.generator])[0])
        state.pending_token_id = token_id
        logprobs = logits[:1].log_softmax(-1)                           # [1, V]
        return StepOutput(request_id, [token_id], 0, [float(logprobs[0, token_id])],
                          top_logprobs(logprobs, params.logprobs))

    def verify(self, request_ids: list[str], draft_token_ids: list[list[int]],
               draft_probs: torch.Tensor | None) -> list[StepOutput]:
        """Score ``[pending, d_1..d_k]`` per request, rejection-sample, commit, roll back the KV.

        Args:
            request_ids: b active requests.
            draft_token_ids: [b][k] draft tokens (the same k for every row; k = 0: decode).
            draft_probs: [b, k, V] draft distributions the drafts were sampled from, or None
                for a deterministic (greedy) drafter.

        Returns:
            b StepOutputs, each with ``num_accepted + 1`` committed tokens.

        Raises:
            KeyError: unknown request. ValueError: ragged k or bad shapes.
            CapacityError: the target KV would exceed ``max_model_len`` (no state changed).
        """
        states = self._states(request_ids)
        if len(draft_token_ids) != len(states):
            raise ValueError(f"draft_token_ids has {len(draft_token_ids)} rows for "
                             f"{len(states)} requests")
        k = len(draft_token_ids[0]) if draft_token_ids else 0
        if any(len(row) != k for row in draft_token_ids):
            raise ValueError("draft_token_ids must have the same k for every request")
        slots = [s.slot for s in states]
        kv_lens = [self.runner.seq_len(slot) for slot in slots]
        fed = [[s.pending_token_id, *row] for s, row in zip(states, draft_token_ids)]
        with _tracer.start_as_current_span("target.forward", attributes={"minedraft.batch_size": len(states),
                                                                          "minedraft.k": k}):
            logits = self.runner.forward(slots, fed)[:, : k + 1]            # [b, k + 1, V]
        with _tracer.start_as_current_span("target.rejection_sample"):
            target_probs = logits_to_probs(logits, [s.params for s in states])
            device = target_probs.device                   # the sampler runs where the logits are
            draft_ids = torch.tensor(draft_token_ids, dtype=torch.int64, device=device).view(len(states), k)
            is_greedy = torch.tensor([s.params.is_greedy for s in states], dtype=torch.bool, device=device)
            generators = [s.generator for s in states]
            if self.fixed_acceptance is not None:   # BENCHMARK-ONLY: not the target's distribution
                output, num_accepted = fixed_acceptance_sample(
                    draft_ids, target_probs, is_greedy, generators,
                    self.fixed_acceptance.acceptance_prob, self._bench_generator)
            else:
                output, num_accepted = rejection_sample(
                    draft_ids, None if draft_probs is None else draft_probs.to(target_probs),
                    target_probs, is_greedy, generators)
            output, num_accepted = output.cpu(), num_accepted.cpu()   # one device sync per step
        logprobs = logits.log_softmax(dim=-1)
        return [self._commit(rid, state, kv_len, output[row], int(num_accepted[row]), logprobs[row])
                for row, (rid, state, kv_len) in enumerate(zip(request_ids, states, kv_lens))]

    def _commit(self, request_id: str, state: _RequestState, kv_len: int, output: torch.Tensor,
                num_accepted: int, logprobs: torch.Tensor) -> StepOutput:
        """Keep pending + accepted drafts in the KV; the last committed token becomes pending."""
        token_ids = output[: num_accepted + 1].tolist()
        self.runner.truncate(state.slot, kv_len + 1 + num_accepted)
        state.pending_token_id = token_ids[-1]
        positions = torch.arange(num_accepted + 1)
        token_logprobs = logprobs[positions, torch.tensor(token_ids)].tolist()
        return StepOutput(request_id, token_ids, num_accepted, token_logprobs,
                          top_logprobs(logprobs[: num_accepted + 1], state.params.logprobs))


class DraftWorker(_Worker):
    """The draft model: catch-up on committed tokens, then k sampled draft tokens per request.

    Draft token ids are always TARGET ids. A draft with a reduced vocabulary (FR-Spec, Zhao et
    al. 2025; ``specdec.draft_format.draft_vocab_ids``) samples an index into its ``N`` logits,
    mapped here to the target id; its probs are scattered into the target vocab, zero elsewhere,
    so rejection sampling stays exact (q = 0 outside the subset).

    Args:
        runner: the draft model's runner.
        target_vocab_size: pad draft probs with zeros to this vocab (None: the draft's input
            vocab); the draft's token ids must be a prefix of the target's (same tokenizer).
        seed: seeds the source of per-request seeds for unseeded requests (None: random).

    Raises:
        ValueError: ``target_vocab_size`` smaller than the draft vocab (or than a reduced
            vocabulary's largest id + 1).
    """

    def __init__(self, runner: ModelRunner, target_vocab_size: int | None = None,
                 seed: int | None = None) -> None:
        super().__init__(runner, seed)
        self.vocab_ids = draft_vocab_ids(runner.model)           # [N] target ids, or None
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(device="cpu", dtype=torch.int64)
        num_ids = runner.vocab_size if self.vocab_ids is None else int(self.vocab_ids.max()) + 1
        self.target_vocab_size = target_vocab_size or max(runner.input_vocab_size, num_ids)
        if self.target_vocab_size < num_ids:
            raise ValueError(f"target_vocab_size={target_vocab_size} < draft vocab {num_ids}")
        self.max_model_len = runner.cache_cfg.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Prefill the prompt into the draft KV (errors as ``TargetWorker.add_request``)."""
        state, _ = self._new_state(request_id, prompt_token_ids, params, is_draft=True)
        state.committed = list(prompt_token_ids)
        state.kv_token_ids = list(prompt_token_ids)

    def can_draft(self, num_committed_tokens: int, k: int) -> bool:
        """Whether a sequence of that many committed tokens fits k draft steps in the draft KV."""
        return num_committed_tokens + k - 1 <= self.max_model_len

    def draft(self, request_ids: list[str], committed: list[tuple[int, list[int]]],
              k: int) -> tuple[list[list[int]], torch.Tensor | None]:
        """Catch up on the committed sequences, then draft k tokens per request.

        Args:
            request_ids: b active requests.
            committed: b pairs ``(start_position, token_ids)``: the committed sequence from
                ``start_position`` on; ``start_position`` must not exceed the length known from
                earlier calls (prompt length at first).
            k: number of draft tokens (>= 0).

        Returns:
            draft token ids [b][k] and draft probs q [b, k, target_vocab_size] float32 (None when
            every request is greedy).

        Raises:
            DraftCapacityError: some sequences would exceed the draft ``max_model_len``
                (raised before any state changes; see ``can_draft``).
            KeyError / ValueError: unknown request, bad ``committed`` or ``k``.
        """
        states = self._states(request_ids)
        if k < 0 or len(committed) != len(states):
            raise ValueError(f"need k >= 0 and one committed entry per request, got k={k}, "
                             f"{len(committed)} entries for {len(states)} requests")
        sequences = [_merge(s.committed, start, ids) for s, (start, ids) in zip(states, committed)]
        too_long = [r for r, seq in zip(request_ids, sequences) if not self.can_draft(len(seq), k)]
        if too_long:
            raise DraftCapacityError(too_long, self.max_model_len)
        for state, sequence in zip(states, sequences):
            state.committed = sequence
        if k == 0:
            return [[] for _ in states], None
        last_logits = self._catch_up(states)
        return self._draft_steps(states, last_logits, k)

    def _catch_up(self, states: list[_RequestState]) -> torch.Tensor:
        """Truncate each KV to its common prefix with the committed sequence, feed the rest.

        Returns the logits of each committed sequence's last token, [b, V].
        """
        fed = []
        for state in states:
            keep = min(_common_prefix_len(state.kv_token_ids, state.committed),
                       len(state.committed) - 1)           # feed >= 1 token to get its logits
            self.runner.truncate(state.slot, keep)
            fed.append(state.committed[keep:])
            state.kv_token_ids = list(state.committed)
        with _tracer.start_as_current_span("draft.catch_up_forward",
                                           attributes={"minedraft.num_tokens": sum(map(len, fed))}):
            logits = self.runner.forward([s.slot for s in states], fed)
        last = torch.tensor([len(row) - 1 for row in fed])
        return logits[torch.arange(len(states)), last]

    def _draft_steps(self, states: list[_RequestState], last_logits: torch.Tensor,
                     k: int) -> tuple[list[list[int]], torch.Tensor | None]:
        """k single-token steps, sampling d_j ~ q_j with each request's draft generator."""
        params = [s.params for s in states]
        is_greedy = [p.is_greedy for p in params]
        generators = [s.generator for s in states]
        tokens, probs = [], []
        for step in range(k):
            with _tracer.start_as_current_span("draft.sample"):
                q = logits_to_probs(last_logits.unsqueeze(1), params)[:, 0]   # [b, V_draft]
                step_tokens = self._to_target_ids(sample_from_probs(q, is_greedy, generators))
            tokens.append(step_tokens)
            probs.append(q)
            if step < k - 1:
                with _tracer.start_as_current_span("draft.forward"):
                    last_logits = self.runner.forward([s.slot for s in states],
                                                      [[t] for t in step_tokens])[:, 0]
                for state, token in zip(states, step_tokens):
                    state.kv_token_ids.append(token)
        draft_ids = [list(row) for row in zip(*tokens)]
        if all(is_greedy):
            return draft_ids, None
        q_all = torch.stack(probs, dim=1).float()                          # [b, k, V_draft]
        return draft_ids, self._to_target_probs(q_all)

    def _to_target_ids(self, indices: torch.Tensor) -> list[int]:
        """Sampled draft logit indices [b] -> target token ids."""
        if self.vocab_ids is None:
            return indices.tolist()
        return self.vocab_ids[indices.cpu()].tolist()

    def _to_target_probs(self, q_all: torch.Tensor) -> torch.Tensor:
        """Draft probs [b, k, V_draft] -> [b, k, target_vocab_size], zero outside the draft vocab."""
        if self.vocab_ids is None:
            pad = self.target_vocab_size - q_all.shape[-1]
            return torch.nn.functional.pad(q_all, (0, pad)) if pad else q_all
        out = q_all.new_zeros(*q_all.shape[:-1], self.target_vocab_size)
        return out.index_copy_(-1, self.vocab_ids.to(q_all.device), q_all)


def _merge(known: list[int], start: int, token_ids: list[int]) -> list[int]:
    """``known[:start] + token_ids``, checking that ``start`` lies inside what is known."""
    if not 0 <= start <= len(known):
        raise ValueError(f"start_position {start} outside the known committed length {len(known)}")
    merged = known[:start] + list(token_ids)
    if not merged:
        raise ValueError("committed sequence is empty")
    return merged


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
