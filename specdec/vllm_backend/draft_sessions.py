"""``VllmSessionDraftWorker``: the vLLM drafter with its draft requests kept resident.

``VllmDraftWorker`` admits one fresh vLLM request per row and draft call, so every call pays
vLLM's admission of each row's whole context (its block hashes, the prefix-cache lookup, the
block allocation and, at the end, the blocks' release: work that grows with the context) and
recomputes each row's uncached last partial KV block. On this CPU (``bench.engines.draft_calls``,
bench/results/HISTORY.md, session 22) a 16-row call of a SmolLM2-135M-shape draft with 400-token contexts took
787 ms that way (523 in its catch-up step) and 388 ms (156) with sessions.

Here each row is one resumable vLLM request for the whole life of the request (vLLM's
"streaming input" sessions: once a request has sampled its ``max_tokens`` it waits, KV blocks
kept, for its next input chunk). A draft call rolls each session back to the longest prefix of
its tokens the verifier kept (``PsdScheduler.resume_session``), hands it the newly committed
tokens as its next chunk and samples k_i draft tokens: the catch-up computes only the tokens
after that prefix, and no row is admitted again. Prefix caching is off for this engine: a
rolled-back block's slots are written again in place, which a block shared through the prefix
cache must never be.

The contract is ``VllmDraftWorker``'s (``specdec.engine_api.DraftEngine``); greedy drafts equal
its drafts. Sampled drafts of a seeded request use one generator per session, seeded once from
the request's seed (reproducible for the same sequence of calls; vLLM seeds a request's
generator when it is admitted).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.sample.sampling import SamplingParams
from specdec.vllm_backend.draft import _UNTIMED, VllmDraftWorker, _DraftRequest
from specdec.vllm_backend.engine import VllmEngineConfig, refusals_as_value_errors, to_vllm_sampling


@dataclass
class _Session:
    vllm_id: str          # the engine's (internal) request id
    tokens: list[int]     # the session's tokens: committed ones, then the last call's draft tokens
    num_computed: int     # tokens whose KV the session holds (all but the last sampled one)
    num_committed: int    # of ``tokens``, those the verifier had committed at the last call


class VllmSessionDraftWorker(VllmDraftWorker):
    """``VllmDraftWorker`` with resident draft sessions (module docstring); the same arguments.

    Raises:
        ValueError: prefix caching on (``cfg.enable_prefix_caching`` must be False),
            ``cfg.proposer_tokens`` set, or as ``VllmDraftWorker``.
    """

    def __init__(self, cfg: VllmEngineConfig, target_vocab_size: int | None = None, seed: int | None = None,
                 engine=None) -> None:
        if cfg.proposer_tokens:
            raise ValueError("proposer_tokens: not with draft sessions (a session's proposals would outlive its call)")
        super().__init__(cfg, target_vocab_size, seed, engine)
        self._sessions: dict[str, _Session] = {}

    @staticmethod
    def _check_caching(cfg: VllmEngineConfig) -> None:
        if cfg.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: must be off for resident draft sessions (a session's "
                             "rolled-back KV slots are written again in place)")

    def _admit(self, new: dict[str, _DraftRequest]) -> None:
        """One resumable vLLM request per new row: its prompt prefilled, one token sampled."""
        sessions = {}
        try:
            for rid, req in new.items():
                params = to_vllm_sampling(req.params, 1, seed=req.seed, with_logprobs=False)
                with refusals_as_value_errors():
                    core_request = self.engine.input_processor.process_inputs(
                        f"{rid}@session", {"prompt_token_ids": list(req.committed)}, params,
                        supported_tasks=self.engine.get_supported_tasks(), resumable=True)
                    sessions[rid] = _Session(self.engine.add_request(core_request.request_id, core_request, params),
                                             list(req.committed), len(req.committed), len(req.committed))
            sampled = self._step_until_done({s.vllm_id: rid for rid, s in sessions.items()}, dict.fromkeys(sessions, 1),
                                            _UNTIMED)
        except BaseException:
            self._abort(sessions)
            raise
        for rid, session in sessions.items():
            session.tokens += sampled[rid]
        self._sessions.update(sessions)

    def _run_drafts(self, jobs: dict[str, tuple[list[int], SamplingParams, int, int]]) -> dict[str, list[int]]:
        calls = {}
        self.call_stats.admitting()
        try:
            for rid, (committed, params, k_i, seed) in jobs.items():
                session = self._sessions[rid]
                same = _common_prefix(session.tokens, committed, session.num_committed)
                kept = min(same, session.num_computed, len(committed) - 1)
                self._scheduler.resume_session(session.vllm_id, kept, committed[kept:], k_i,
                                               to_vllm_sampling(params, k_i, seed=seed, with_logprobs=False))
                calls[rid] = session
            self.call_stats.admitted()
            drafted = self._step_until_done({calls[rid].vllm_id: rid for rid in jobs},
                                            {rid: k_i for rid, (*_, k_i, _) in jobs.items()}, self.call_stats)
        except BaseException:   # a session left half-resumed cannot be trusted again: forget the call's rows
            self._abort({rid: self._sessions[rid] for rid in jobs})
            for rid in jobs:
                self._requests.pop(rid, None)
            raise
        for rid, (committed, _, k_i, _) in jobs.items():
            self._sessions[rid] = _Session(calls[rid].vllm_id, list(committed) + drafted[rid],
                                           len(committed) + k_i - 1, len(committed))
        return drafted

    def _abort(self, sessions: dict[str, _Session]) -> None:
        if sessions:
            self.engine.abort_request([s.vllm_id for s in sessions.values()], internal=True)
        for rid in sessions:
            self._sessions.pop(rid, None)

    def release(self, request_id: str) -> None:
        """Forget the request and free its session's KV blocks. Raises KeyError for an unknown id."""
        super().release(request_id)
        self._abort({request_id: self._sessions[request_id]})


def _common_prefix(a: list[int], b: list[int], hint: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``; ``hint``: a length they likely
    share (checked at C speed, then the scan goes on from it; from 0 if they do not)."""
    n = min(len(a), len(b))
    i = min(hint, n)
    if a[:i] != b[:i]:
        i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
