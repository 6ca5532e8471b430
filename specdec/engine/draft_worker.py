"""The draft-model engine worker: catch-up on committed tokens, then k draft tokens per request.

State contract (docs/ARCHITECTURE.md, "Terms"): per request, the KV holds some token list.
``draft`` first brings it to the committed sequence (keep the common prefix, feed the rest:
*catch-up*), then runs k single-token steps; the KV ends holding ``committed + d_1..d_{k-1}``.
With a per-request k_i (ragged rows) a request stops being fed once it has its k_i tokens, so
its KV ends holding ``committed + d_1..d_{k_i-1}`` as if drafted alone with k = k_i (a request
with k_i = 0 is not even caught up: its KV stays as it was, the next call catches it up).
Imported as ``specdec.engine.worker.DraftWorker`` too.
"""

from __future__ import annotations

import torch

from specdec.models.draft_format import draft_vocab_ids
from specdec.sample.penalties import apply_penalties
from specdec.engine.runner import ModelRunner
from specdec.sample.sampling import SamplingParams, logits_to_probs, sample_from_probs
from specdec.engine.worker_base import DraftCapacityError, Worker, RequestState, penalty_history
from specdec.engine.worker_base import tracer as _tracer


class DraftWorker(Worker):
    """The draft model: catch-up on committed tokens, then k sampled draft tokens per request.

    Draft token ids are always TARGET ids. A draft with a reduced vocabulary (FR-Spec, Zhao et
    al. 2025; ``specdec.models.draft_format.draft_vocab_ids``) samples an index into its ``N`` logits,
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
        """Prefill the prompt into the draft KV (one request of ``add_requests``)."""
        self.add_requests([(request_id, prompt_token_ids, params)])

    def add_requests(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Prefill ``(request_id, prompt_token_ids, params)`` prompts into the draft KV, several
        per forward (``ModelConfig.max_prefill_tokens``); all or nothing (errors as
        ``TargetWorker.add_requests``)."""
        for (_, prompt, _), (state, _) in zip(items, self._new_states(items, is_draft=True)):
            state.committed = list(prompt)
            state.kv_token_ids = list(prompt)
            state.num_prompt_tokens = len(prompt)

    def facts(self):
        """``EngineFacts`` of the draft runner; sampled drafts come with draft probabilities."""
        from dataclasses import replace

        return replace(super().facts(), sends_draft_probs=True)

    def can_draft(self, num_committed_tokens: int, k: int) -> bool:
        """Whether a sequence of that many committed tokens fits k draft steps in the draft KV."""
        return num_committed_tokens + k - 1 <= self.max_model_len

    def draft(self, request_ids: list[str], committed: list[tuple[int, list[int]]],
              k: int | list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Catch up on the committed sequences, then draft k_i tokens per request.

        Ragged k: the batch runs ``max k_i`` single-token steps, and a request takes part in
        the first k_i of them only (it is neither sampled nor fed after that), so its tokens,
        its generator's draws and its KV are those of a call with k = k_i alone.

        Args:
            request_ids: b active requests.
            committed: b pairs ``(start_position, token_ids)``: the committed sequence from
                ``start_position`` on; ``start_position`` must not exceed the length known from
                earlier calls (prompt length at first).
            k: number of draft tokens (>= 0), one for all or a list of b per-request k_i.

        Returns:
            draft token ids, b rows of k_i ids, and draft probs q [b, max k_i, target_vocab_size]
            float32, zero at positions >= k_i of row i (padding, never to be read); None when
            every request is greedy.

        Raises:
            DraftCapacityError: some sequences would exceed the draft ``max_model_len``
                (raised before any state changes; see ``can_draft``).
            KeyError / ValueError: unknown request, bad ``committed`` (start, or a token id
                outside the input vocab) or ``k``; no state changes.
        """
        states = self._states(request_ids)
        ks = [k] * len(states) if isinstance(k, int) else list(k)
        if min(ks, default=0) < 0 or len(committed) != len(states) or len(ks) != len(states):
            raise ValueError(f"need k >= 0 and one committed entry and k per request, got k={k}, "
                             f"{len(committed)} entries for {len(states)} requests")
        vocab_size = self.runner.input_vocab_size
        bad = [rid for rid, (_, ids) in zip(request_ids, committed) if any(not 0 <= t < vocab_size for t in ids)]
        if bad:  # checked before any state changes: a failed catch-up would leave the KV behind kv_token_ids
            raise ValueError(f"committed token ids of {bad} must lie in [0, {vocab_size})")
        sequences = [merge_committed(s.committed, start, ids) for s, (start, ids) in zip(states, committed)]
        too_long = [r for r, seq, k_i in zip(request_ids, sequences, ks) if not self.can_draft(len(seq), k_i)]
        if too_long:
            raise DraftCapacityError(too_long, self.max_model_len)
        for state, sequence in zip(states, sequences):
            state.committed = sequence
        rows = [row for row, k_i in enumerate(ks) if k_i > 0]
        if not rows:
            return [[] for _ in states], None
        last_logits = self._catch_up([states[row] for row in rows])
        return self._draft_steps(states, rows, last_logits, ks)

    def _catch_up(self, states: list[RequestState]) -> torch.Tensor:
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
            return self.runner.prefill([s.slot for s in states], fed)   # LM head on last tokens only

    def _draft_steps(self, states: list[RequestState], rows: list[int], last_logits: torch.Tensor,
                     ks: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """``max k_i`` single-token steps, sampling d_j ~ q_j with each request's draft generator;
        ``rows`` are the requests still drafting (k_i > step), ``last_logits`` [len(rows), V]."""
        is_greedy = [s.params.is_greedy for s in states]
        tokens: list[list[int]] = [[] for _ in states]
        steps: list[tuple[list[int], torch.Tensor]] = []                    # (rows, q [rows, V])
        for step in range(max(ks)):
            with _tracer.start_as_current_span("draft.sample"):
                params = [states[r].params for r in rows]   # penalties: history = output + own drafts
                scored = apply_penalties(last_logits.unsqueeze(1), params,
                                         [penalty_history(states[r], tokens[r]) for r in rows], vocab_ids=self.vocab_ids)
                q = logits_to_probs(scored, params)[:, 0]
                sampled = sample_from_probs(q, [is_greedy[r] for r in rows], [states[r].generator for r in rows])
            for row, token in zip(rows, self._to_target_ids(sampled)):
                tokens[row].append(token)
            steps.append((rows, q))
            fed = [i for i, row in enumerate(rows) if ks[row] > step + 1]
            if not fed:
                break
            rows = [rows[i] for i in fed]
            with _tracer.start_as_current_span("draft.forward"):
                last_logits = self.runner.forward([states[r].slot for r in rows],
                                                  [[tokens[r][-1]] for r in rows])[:, 0]
            for row in rows:
                states[row].kv_token_ids.append(tokens[row][-1])
        if all(is_greedy):
            return tokens, None
        return tokens, self._to_target_probs(_stack_ragged(steps, len(states)))

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


def _stack_ragged(steps: list[tuple[list[int], torch.Tensor]], batch_size: int) -> torch.Tensor:
    """[b, num_steps, V] float32 draft probs from per-step (rows, q [rows, V]); zero where a row
    did not draft (its positions >= k_i)."""
    first = steps[0][1]
    out = first.new_zeros(batch_size, len(steps), first.shape[-1], dtype=torch.float32)
    for step, (rows, q) in enumerate(steps):
        out[torch.tensor(rows, device=out.device), step] = q.float()
    return out


def merge_committed(known: list[int], start: int, token_ids: list[int]) -> list[int]:
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
