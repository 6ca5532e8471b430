"""Engine workers: the target model (prefill + verify) and the draft model (catch-up + draft).

Both services wrap these classes, and so do the in-process reference loops
(``reference.loop``). State contract (docs/ARCHITECTURE.md, "Terms"):

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

import torch

from specdec.engine.draft_worker import DraftWorker
from specdec.sample.fixed_acceptance import FixedAcceptance, fixed_acceptance_sample
from specdec.sample.penalties import apply_penalties
from specdec.sample.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import NO_LOGPROBS, SamplingParams, logits_to_probs, sample_from_probs
from specdec.engine.worker_base import (DraftCapacityError, RequestState, StepOutput, Worker, decode_steps, penalty_history,
                                 top_logprobs)
from specdec.engine.worker_base import tracer as _tracer

__all__ = ["DraftCapacityError", "DraftWorker", "StepOutput", "TargetWorker", "top_logprobs"]


class TargetWorker(Worker):
    """The target model: prefill + first token, then verify steps (k = 0 is plain decode).

    Args:
        runner: the target model's runner (one per worker).
        seed: seeds the source of per-request seeds for unseeded requests (None: random).
        fixed_acceptance: BENCHMARK-ONLY: accept each draft token with a fixed probability
            instead of rejection sampling (``specdec.sample.fixed_acceptance``; changes the output
            distribution). None (default): the exact rejection sampler.
    """

    def __init__(self, runner: ModelRunner, seed: int | None = None,
                 fixed_acceptance: FixedAcceptance | None = None) -> None:
        super().__init__(runner, seed)
        self.fixed_acceptance = fixed_acceptance
        self._bench_generator = None if fixed_acceptance is None else fixed_acceptance.make_generator()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> StepOutput:
        """Prefill the prompt and sample the first output token from the target (one request of
        ``add_requests``; same errors)."""
        return self.add_requests([(request_id, prompt_token_ids, params)])[0]

    def add_requests(self, items: list[tuple[str, list[int], SamplingParams]]) -> list[StepOutput]:
        """Prefill ``(request_id, prompt_token_ids, params)`` prompts (several per forward, see
        ``ModelConfig.max_prefill_tokens``) and sample each one's first output token from the
        target; all or nothing.

        Raises:
            ValueError: duplicate id or empty prompt. CapacityError: no slot / prompt too long.
        """
        outputs = []
        for (request_id, prompt, params), (state, logits) in zip(items, self._new_states(items, is_draft=False)):
            if params.has_penalties:                                     # their history
                state.committed, state.num_prompt_tokens = list(prompt), len(prompt)
            logits = logits.unsqueeze(0)                                 # [1, V]
            scored = apply_penalties(logits.unsqueeze(1), [params], [penalty_history(state)])
            probs = logits_to_probs(scored, [params])[:, 0]
            token_id = int(sample_from_probs(probs, [params.is_greedy], [state.generator])[0])
            state.pending_token_id = token_id
            if params.has_penalties:
                state.committed.append(token_id)
            logprobs = logits.log_softmax(-1)                            # [1, V]
            chosen = [] if params.logprobs == NO_LOGPROBS else [float(logprobs[0, token_id])]
            outputs.append(StepOutput(request_id, [token_id], 0, chosen,
                                      top_logprobs(logprobs, params.logprobs)))
        return outputs

    def verify(self, request_ids: list[str], draft_token_ids: list[list[int]],
               draft_probs: torch.Tensor | None) -> list[StepOutput]:
        """Score ``[pending, d_1..d_{k_i}]`` per request, rejection-sample, commit, roll back the KV.

        Rows may be ragged: row i carries its own k_i = ``len(draft_token_ids[i])`` (0: decode).
        Each row feeds only its k_i + 1 real tokens (``ModelRunner.forward`` takes ragged rows;
        its padding is never written to the KV), so a short row costs no verify work for the
        positions it lacks; the logits past a row's k_i + 1 positions are ignored.

        Args:
            request_ids: b active requests.
            draft_token_ids: b rows of draft tokens, row i of length k_i (k = max k_i).
            draft_probs: [b, k', V] draft distributions the drafts were sampled from (k' >= k;
                positions >= k_i of row i are padding and never read), or None for a
                deterministic (greedy) drafter.

        Returns:
            b StepOutputs, each with ``num_accepted + 1`` committed tokens (num_accepted <= k_i).

        Raises:
            KeyError: unknown request. ValueError: bad shapes.
            CapacityError: the target KV would exceed ``max_model_len`` (no state changed).
        """
        states = self._states(request_ids)
        if len(draft_token_ids) != len(states):
            raise ValueError(f"draft_token_ids has {len(draft_token_ids)} rows for "
                             f"{len(states)} requests")
        lengths = [len(row) for row in draft_token_ids]
        k = max(lengths, default=0)
        if draft_probs is not None and (draft_probs.dim() != 3 or draft_probs.shape[0] != len(states)
                                        or draft_probs.shape[1] < k):
            raise ValueError(f"draft_probs must be [{len(states)}, >= {k}, V], got {tuple(draft_probs.shape)}")
        slots = [s.slot for s in states]
        kv_lens = [self.runner.seq_len(slot) for slot in slots]
        fed = [[s.pending_token_id, *row] for s, row in zip(states, draft_token_ids)]
        with _tracer.start_as_current_span("target.forward", attributes={"minedraft.batch_size": len(states),
                                                                          "minedraft.k": k}):
            logits = _mask_padding(self.runner.forward(slots, fed)[:, : k + 1], lengths)  # [b, k + 1, V]
        with _tracer.start_as_current_span("target.rejection_sample"):
            device = logits.device                         # the sampler runs where the logits are
            padded = [row + [PLACEHOLDER_TOKEN_ID] * (k - len(row)) for row in draft_token_ids]
            draft_ids = torch.tensor(padded, dtype=torch.int64, device=device).view(len(states), k)
            num_draft = torch.tensor(lengths, dtype=torch.int64, device=device)
            probs = None if draft_probs is None else draft_probs[:, :k]
            # position j's penalties count d_1..d_j as output (the history if they are accepted)
            scored = apply_penalties(logits, [s.params for s in states], [penalty_history(s) for s in states],
                                     draft_token_ids)
            output, num_accepted = self._sample(states, draft_ids, probs, scored, num_draft)
            output, num_accepted = output.cpu(), num_accepted.cpu()   # one device sync per step
        logprobs = logits.log_softmax(dim=-1)
        return [self._commit(rid, state, kv_len, output[row], int(num_accepted[row]), logprobs[row])
                for row, (rid, state, kv_len) in enumerate(zip(request_ids, states, kv_lens))]

    def decode(self, request_ids: list[str], num_steps: int, on_step=None,
               max_steps: list[int] | None = None) -> list[StepOutput]:
        """``num_steps`` decode steps in one call, row i at most ``max_steps[i]``
        (``specdec.engine.worker_base.decode_steps``)."""
        return decode_steps(self, request_ids, num_steps, on_step, max_steps)

    def _sample(self, states: list[RequestState], draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                logits: torch.Tensor, num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [b, k + 1], num_accepted [b]) of the rejection sampler for rows of k_i =
        ``num_draft`` [b] draft tokens; an all-greedy batch takes ``greedy_verify`` (same
        tokens, no probabilities built)."""
        is_greedy = torch.tensor([s.params.is_greedy for s in states], dtype=torch.bool, device=logits.device)
        if self.fixed_acceptance is None and bool(is_greedy.all()):
            return greedy_verify(draft_ids, logits, num_draft)
        target_probs = logits_to_probs(logits, [s.params for s in states])
        generators = [s.generator for s in states]
        if self.fixed_acceptance is not None:   # BENCHMARK-ONLY: not the target's distribution
            return fixed_acceptance_sample(draft_ids, target_probs, is_greedy, generators,
                                           self.fixed_acceptance.acceptance_prob, self._bench_generator,
                                           num_draft)
        return rejection_sample(draft_ids, None if draft_probs is None else draft_probs.to(target_probs),
                                target_probs, is_greedy, generators, num_draft)

    def _commit(self, request_id: str, state: RequestState, kv_len: int, output: torch.Tensor,
                num_accepted: int, logprobs: torch.Tensor) -> StepOutput:
        """Keep pending + accepted drafts in the KV; the last committed token becomes pending."""
        token_ids = output[: num_accepted + 1].tolist()
        self.runner.truncate(state.slot, kv_len + 1 + num_accepted)
        state.pending_token_id = token_ids[-1]
        if state.params.has_penalties:
            state.committed += token_ids
        positions = torch.arange(num_accepted + 1)
        token_logprobs = ([] if state.params.logprobs == NO_LOGPROBS
                          else logprobs[positions, torch.tensor(token_ids)].tolist())
        return StepOutput(request_id, token_ids, num_accepted, token_logprobs,
                          top_logprobs(logprobs[: num_accepted + 1], state.params.logprobs))


def _mask_padding(logits: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Zero the logits [b, k + 1, V] at positions past each row's k_i + 1 fed tokens (junk from
    the runner's padding; never read, zeroed so no NaN or inf can reach a sampler's kernels)."""
    k = logits.shape[1] - 1
    if all(length == k for length in lengths):
        return logits
    fed = torch.tensor(lengths, device=logits.device).unsqueeze(1) + 1
    is_fed = torch.arange(k + 1, device=logits.device).unsqueeze(0) < fed        # [b, k + 1]
    return logits.masked_fill(~is_fed.unsqueeze(-1), 0.0)


def greedy_verify(draft_ids: torch.Tensor, logits: torch.Tensor,
                  num_draft_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` for an all-greedy batch, straight from the logits: accept while
    ``d_i == argmax p_i`` (at most k_i), then emit the target argmax (Leviathan et al. 2023 at
    temperature 0; the same tokens as the full sampler with one-hot target probs, which greedy
    rows draw no randomness for), without building ``[b, k + 1, V]`` probabilities (issue 8 CPU
    profile).

    Shapes: draft_ids ``[b, k]`` int64 (positions >= k_i: padding), logits ``[b, k + 1, V]``,
    num_draft_tokens ``[b]`` int64 k_i in [0, k] (None: k for every row); returns output
    ``[b, k + 1]`` int64 (accepted drafts, then the recovered/bonus token, then
    ``PLACEHOLDER_TOKEN_ID``) and num_accepted ``[b]`` int64.
    """
    target_ids = logits.argmax(dim=-1)                                   # [b, k + 1]
    k = draft_ids.shape[1]
    is_match = draft_ids == target_ids[:, :k]
    if num_draft_tokens is not None:
        is_match &= torch.arange(k, device=logits.device).unsqueeze(0) < num_draft_tokens.unsqueeze(1)
    num_accepted = is_match.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    positions = torch.arange(k + 1, device=logits.device).unsqueeze(0)
    output = torch.where(positions <= num_accepted.unsqueeze(1), target_ids, PLACEHOLDER_TOKEN_ID)
    return output, num_accepted
