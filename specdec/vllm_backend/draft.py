"""``VllmDraftWorker``: the draft model on vLLM, behind the drafter's engine seam.

The same contract as ``specdec.engine.draft_worker.DraftWorker`` (``specdec.engine_api.DraftEngine``):
``add_requests`` admits requests, ``draft`` catches up on the tokens the verifier committed and
drafts k_i tokens for the named batch, ``release`` forgets a request.

Underneath, each ``draft`` call asks vLLM for k_i new tokens of every row's committed sequence
(one short-lived vLLM request per row, ``max_tokens = k_i``) and steps the engine until all
rows are done. vLLM's automatic prefix caching keeps every committed prefix's KV blocks, so the
catch-up computes only the last partial block and the newly committed tokens, then k_i - 1
decode steps follow: the work of a drafter with its own resident KV, on vLLM's kernels and
CUDA graphs. ``add_requests`` prefills each prompt once so that the prompt's KV is cached
before the request's first draft. So that each call takes k_i engine steps, the engine is built
by ``drafting_config``: KV blocks of 32 tokens on CPU (vLLM's CPU default of 128 made every
catch-up recompute up to 127 tokens a row, and 16 rows' catch-ups overflowed one step's token
budget: 5.7 steps per k = 4 call, 4.0 after), a step budget that holds every row's catch-up,
and on CUDA whole CUDA graphs captured up to that step size (the catch-up step ran without them).

With ``proposer_tokens`` n (``--draft-proposer``: n = k - 1) the engine carries vLLM's own
``draft_model`` proposer with this same model: the step that catches up and samples a row's first
token also proposes its next n tokens, greedily, inside the step, so a call of k_i <= n + 1 takes
one engine step instead of k_i (``_complete_from_proposals``; the rows leave the engine after it).
The drafts are then the sampled first token and its greedy continuation: still lossless, as the
verifier treats every draft token as a one-hot q (below).

Draft tokens are sampled with the request's temperature / top-k / top-p / min-p; a seeded
request gets a seed per draft call derived from its seed and its committed length, so a seeded
run is reproducible. Draft probabilities are not returned (``None``): vLLM's rejection sampler
needs none, and the native verifier then treats q as the one-hot of each draft token, which
stays lossless (``specdec.sample.rejection``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from specdec.engine.draft_worker import merge_committed
from specdec.engine_api import EngineFacts
from specdec.errors import CapacityError
from specdec.sample.sampling import NO_LOGPROBS, SamplingParams
from specdec.vllm_backend.bookkeeping import check_new_ids, check_token_ids, known_states
from specdec.vllm_backend.call_stats import DraftCallStats
from specdec.vllm_backend.engine import (VLLM_BLOCK_SIZE, VllmEngineConfig, build_engine, drain,
                                         refusals_as_value_errors, scheduler_of, to_vllm_sampling)
from specdec.vllm_backend.outputs import core_step, engine_facts
from specdec.engine.worker_base import DraftCapacityError

_SEED_BITS = 63
_SEED_MIX = 0x9E3779B97F4A7C15   # golden-ratio constant: decorrelates per-call draft seeds
MAX_DRAFT_STEPS_SLACK = 64       # engine steps beyond k allowed for chunked catch-ups
DRAFT_BLOCK_SIZE = {"cpu": 32}   # KV block tokens on CPU: the smallest vLLM's CPU attention takes
DRAFT_CUDAGRAPH_MODE = "FULL"    # CUDA: whole graphs for the catch-up step as for decode steps
MAX_DRAFT_GRAPH_TOKENS = 1024   # CUDA: the largest graphed step: a typical catch-up (~12 tokens a row) of 85 rows
CATCH_UP_NEW_TOKENS = 16         # committed tokens per row and call the step budget holds (k <= 15)


def drafting_config(cfg: VllmEngineConfig) -> VllmEngineConfig:
    """``cfg`` with the draft engine's defaults where it leaves them open: on CPU ``block_size``
    32 (a catch-up recomputes the uncached part of the last block, up to block_size - 1 tokens a
    row; vLLM's CPU default is 128), ``max_num_batched_tokens`` at least ``max_num_seqs x
    (block_size + CATCH_UP_NEW_TOKENS)``, so every row's catch-up fits the call's first step, and
    on CUDA whole CUDA graphs (``cudagraph_mode`` FULL; vLLM falls back to FULL_AND_PIECEWISE
    where the attention backend cannot) up to that many tokens, at most ``MAX_DRAFT_GRAPH_TOKENS``
    (``max_cudagraph_capture_size``; each size is one graph captured at start-up), so the catch-up
    step, a mixed prefill + decode step, runs on graphs too. vLLM's defaults
    (graphs up to ``2 x max_num_seqs`` tokens for an engine without speculation, piecewise for
    mixed steps) left it at 21-30 ms against 2.7-3.9 ms per decode step at 8-32 rows for a
    Qwen3-0.6B shape on the H200; FULL graphs up to the catch-up size: 4.2-7.4 ms
    (``bench.engines.draft_calls``, bench/results/HISTORY.md, session 21)."""
    block = cfg.block_size or DRAFT_BLOCK_SIZE.get(cfg.device)
    catch_up = cfg.max_num_seqs * ((block or VLLM_BLOCK_SIZE[cfg.device]) + CATCH_UP_NEW_TOKENS)
    budget = cfg.max_num_batched_tokens or max(cfg.batched_tokens, catch_up)
    on_cuda = cfg.device == "cuda"
    graphs = cfg.max_cudagraph_capture_size or (min(budget, catch_up, MAX_DRAFT_GRAPH_TOKENS) if on_cuda else None)
    mode = cfg.cudagraph_mode or (DRAFT_CUDAGRAPH_MODE if on_cuda else None)
    return replace(cfg, block_size=block, max_num_batched_tokens=budget, max_cudagraph_capture_size=graphs,
                   cudagraph_mode=mode)


@dataclass
class _DraftRequest:
    committed: list[int]
    params: SamplingParams
    seed: int


class VllmDraftWorker:
    """Draft-model worker on an in-process vLLM engine (see module docstring).

    Args:
        cfg: the engine settings (``enable_prefix_caching`` must be on; ``drafting_config`` fills
            in block size and step budget).
        target_vocab_size: the target's vocabulary (draft ids must lie below it; None: the draft's).
        seed: seeds the per-request seeds of unseeded requests (None: random).
        engine: an engine built from ``cfg`` (tests share one); None builds it.

    Raises:
        ValueError: prefix caching off, or a draft vocabulary larger than ``target_vocab_size``.
    """

    def __init__(self, cfg: VllmEngineConfig, target_vocab_size: int | None = None, seed: int | None = None,
                 engine=None) -> None:
        self._check_caching(cfg)
        self.cfg = cfg = drafting_config(cfg)
        self.engine = engine if engine is not None else build_engine(cfg)
        self._scheduler = scheduler_of(self.engine)
        self._facts = engine_facts(self.engine, cfg)
        if target_vocab_size is not None and target_vocab_size < self._facts.vocab_size:
            raise ValueError(f"target_vocab_size={target_vocab_size} < draft vocab {self._facts.vocab_size}")
        self._requests: dict[str, _DraftRequest] = {}
        self._seed_source = random.Random(seed)
        self._num_calls = 0
        self.call_stats = DraftCallStats()   # each draft call's admission / first step / later steps, logged

    @staticmethod
    def _check_caching(cfg: VllmEngineConfig) -> None:
        if not cfg.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: the vLLM drafter needs it on (its catch-up reuses cached KV)")

    def facts(self) -> EngineFacts:
        return self._facts.with_free_slots(self.cfg.max_num_seqs - len(self._requests))

    def can_draft(self, num_committed_tokens: int, k: int) -> bool:
        """Whether a sequence of that many committed tokens fits k more in ``max_model_len``."""
        return num_committed_tokens + k <= self.cfg.max_model_len

    def add_requests(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Admit ``(request id, prompt ids, params)`` requests and prefill their prompts into the
        prefix cache; all or none.

        Raises:
            ValueError: a repeated or active id, an empty prompt, a token id out of range.
            CapacityError: no free slot, or a prompt of ``max_model_len`` tokens or more.
        """
        ids = [rid for rid, _, _ in items]
        check_new_ids(self._requests, ids, self.cfg.max_num_seqs)
        for rid, prompt, _ in items:
            if not prompt:
                raise ValueError(f"prompt_token_ids of {rid!r} must not be empty")
            if not self.can_draft(len(prompt), 1):
                raise CapacityError(f"prompt of {rid!r} has {len(prompt)} tokens; max_model_len is {self.cfg.max_model_len}")
            self._check_ids(rid, prompt)
        new = {rid: _DraftRequest(list(prompt), params, self._request_seed(params)) for rid, prompt, params in items}
        self._admit(new)
        self._requests.update(new)

    def _admit(self, new: dict[str, "_DraftRequest"]) -> None:
        """Prefill the new requests' prompts (here: into the prefix cache, one token sampled)."""
        self._generate({rid: (req.committed, req.params, 1, req.seed) for rid, req in new.items()}, _UNTIMED)

    def _request_seed(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._seed_source.getrandbits(_SEED_BITS)

    def _check_ids(self, request_id: str, token_ids: list[int]) -> None:
        check_token_ids(request_id, token_ids, self._facts.input_vocab_size)

    def draft(self, request_ids: list[str], committed: list[tuple[int, list[int]]],
              k: int | list[int]) -> tuple[list[list[int]], None]:
        """Catch up on the committed sequences, then draft k_i tokens per request.

        Args:
            request_ids: b admitted requests.
            committed: b pairs ``(start_position, token_ids)``: the committed sequence from
                ``start_position`` on (``start_position`` within what earlier calls gave).
            k: draft tokens per request (>= 0): one for all, or b values k_i.

        Returns:
            (b rows of k_i draft token ids, None: no draft probabilities).

        Raises:
            KeyError: unknown request. ValueError: bad ``committed`` or ``k`` (no state changes).
            DraftCapacityError: a sequence would pass ``max_model_len`` (no state changes).
        """
        self.call_stats.start(len(request_ids))
        states = known_states(self._requests, request_ids)
        ks = [k] * len(states) if isinstance(k, int) else list(k)
        if min(ks, default=0) < 0 or len(committed) != len(states) or len(ks) != len(states):
            raise ValueError(f"need k >= 0 and one committed entry and k per request, got k={k}, "
                             f"{len(committed)} entries for {len(states)} requests")
        for rid, (_, ids) in zip(request_ids, committed):
            self._check_ids(rid, ids)
        sequences = [merge_committed(s.committed, start, ids) for s, (start, ids) in zip(states, committed)]
        too_long = [rid for rid, seq, k_i in zip(request_ids, sequences, ks) if not self.can_draft(len(seq), k_i)]
        if too_long:
            raise DraftCapacityError(too_long, self.cfg.max_model_len)
        for state, sequence in zip(states, sequences):
            state.committed = sequence
        jobs = {rid: (s.committed, s.params, k_i, _call_seed(s.seed, len(s.committed)))
                for rid, s, k_i in zip(request_ids, states, ks) if k_i > 0}
        drafted = self._run_drafts(jobs) if jobs else {}
        return [drafted.get(rid, []) for rid in request_ids], None

    def _run_drafts(self, jobs: dict[str, tuple[list[int], SamplingParams, int, int]]) -> dict[str, list[int]]:
        """{request id: its k_i draft tokens} for ``jobs`` of (committed tokens, params, k_i, seed)."""
        return self._generate(jobs, self.call_stats)

    def _generate(self, jobs: dict[str, tuple[list[int], SamplingParams, int, int]],
                  stats: DraftCallStats) -> dict[str, list[int]]:
        """{request id: the ``n`` tokens vLLM samples after ``tokens``} for ``jobs`` of
        (tokens, params, n, seed), all in one engine run (timed by ``stats``); aborted again on failure."""
        self._num_calls += 1
        stats.admitting()
        rows, vllm_ids = {}, []
        try:
            for rid, (prompt, params, n, seed) in jobs.items():
                with refusals_as_value_errors():
                    vllm_ids.append(self.engine.add_request(f"{rid}@draft{self._num_calls}", {"prompt_token_ids": prompt},
                                                            to_vllm_sampling(params, n, seed=seed, with_logprobs=False)))
                rows[vllm_ids[-1]] = rid
            stats.admitted()
            tokens = self._step_until_done(rows, {rid: n for rid, (_, _, n, _) in jobs.items()}, stats,
                                           use_proposals=self._proposals_serve(jobs))
        except BaseException:
            if vllm_ids:
                self.engine.abort_request(vllm_ids, internal=True)
            raise
        # they ended in the engine core (or were aborted there once their proposals completed them);
        # core_step left their states in the output processor
        self.engine.output_processor.abort_requests(vllm_ids, internal=True)
        return tokens

    def _proposals_serve(self, jobs: dict[str, tuple[list[int], SamplingParams, int, int]]) -> bool:
        """Whether this call's rows take the proposer's tokens: ``proposer_tokens`` on, no row with
        penalties (the proposer drafts the plain argmax; the k-step drafts apply them, which the
        verifier then accepts more often) and no row within ``proposer_tokens`` of
        ``max_model_len`` (vLLM's CPU build then proposes 0 for every row of the step). Otherwise the
        call runs as vLLM's own speculative steps, one verified token or more per step: the same
        tokens as k-step drafting, in up to k_i steps."""
        return bool(self.cfg.proposer_tokens) and all(
            not params.has_penalties and len(tokens) + self.cfg.proposer_tokens <= self.cfg.max_model_len
            for tokens, params, _, _ in jobs.values())

    def _step_until_done(self, rows: dict[str, str], wants: dict[str, int], stats: DraftCallStats,
                         use_proposals: bool = False) -> dict[str, list[int]]:
        """Step the engine until every engine request of ``rows`` ({vLLM's internal request id: row
        id}) has its tokens (``wants``: how many per row id; each step marked in ``stats``); those
        tokens per row id. Each step is read from the engine core (``core_step``: no output
        processor). With ``use_proposals`` a row is done once its sampled tokens and the
        proposals vLLM's draft-model proposer made after them in the same step make ``wants``
        (``_proposed_tokens``); a row they do not complete (a catch-up over several steps, k_i above
        ``proposer_tokens + 1``) goes on as a request of vLLM's own speculative decoding, whose
        verified proposals come out of its later steps. Raises RuntimeError if they do not finish within
        ``MAX_DRAFT_STEPS_SLACK`` extra steps."""
        tokens: dict[str, list[int]] = {rid: [] for rid in rows.values()}
        pending = set(tokens)
        names = {vllm_id: (rid, NO_LOGPROBS) for vllm_id, rid in rows.items()}
        for _ in range(max(wants.values()) + MAX_DRAFT_STEPS_SLACK):
            outputs = core_step(self.engine, names)
            stats.stepped()
            for rid, output in outputs.items():
                if rid in pending:
                    tokens[rid] += output.token_ids
                    if output.finish_reason is not None:
                        pending.discard(rid)
            if use_proposals:
                self._complete_from_proposals(rows, wants, tokens, pending)
            if not pending:
                drain(self.engine)   # async scheduling: a step scheduled past the end
                stats.end()
                return tokens
        raise RuntimeError(f"vLLM drafting did not finish: {sorted(pending)}")

    def _complete_from_proposals(self, rows: dict[str, str], wants: dict[str, int], tokens: dict[str, list[int]],
                                 pending: set[str]) -> None:
        """After a step: each pending row whose sampled tokens and the proposals after them make
        its ``wants`` takes those proposals and leaves the engine (aborted: no step more); the
        others' tokens come out of later steps, where vLLM verifies the proposals."""
        done = []
        for vllm_id, rid in rows.items():
            need = wants[rid] - len(tokens[rid])
            if rid in pending and tokens[rid] and len(proposed := self._proposed_tokens(vllm_id)) >= need:
                tokens[rid] += proposed[:need]
                done.append(vllm_id)
                pending.discard(rid)
        if done:
            self.engine.abort_request(done, internal=True)

    def _proposed_tokens(self, vllm_id: str) -> list[int]:
        """The draft tokens vLLM's proposer made for request ``vllm_id`` in the engine's last step
        (``Request.spec_token_ids``, set after the step by ``Scheduler.update_draft_token_ids``); []
        once it finished or where none were made (a prefill chunk)."""
        request = self._scheduler.requests.get(vllm_id)
        return [] if request is None or request.is_finished() else list(request.spec_token_ids)

    def release(self, request_id: str) -> None:
        """Forget the request (its cached prefix blocks age out of vLLM's prefix cache).
        Raises KeyError for an unknown id."""
        del self._requests[request_id]

    @property
    def num_active(self) -> int:
        return len(self._requests)


_UNTIMED = DraftCallStats(log_every=0)   # admissions: not draft calls


def _call_seed(seed: int, num_committed: int) -> int:
    """The seed of one draft call: a function of the request's seed and its committed length."""
    return (seed ^ (num_committed * _SEED_MIX)) % (1 << _SEED_BITS)
