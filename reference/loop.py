"""In-process reference loops ``ar`` / ``sd`` / ``psd`` over the engine workers (CLI: ``reference.cli``).

- ``ar``: the target model alone; every step is a verify step with k = 0 (plain decode).
- ``sd``: standard speculative decoding (Leviathan et al. 2023): draft k tokens for the running
  batch, then verify them, one after the other.
- ``psd``: MineDraft batch-parallel SD (Tang, Verma et al. 2026, §5.1): two batches managed by
  ``coordinator.batch_manager.BatchManager``; each step drafts ``skip_batch`` while the other
  batch is verified with the drafts made for it at the previous step, then the roles flip. Here
  both halves run in turn in one process: the loop checks the algorithm, not the overlap. A
  verify-batch request without drafts yet (first step, after an SD fallback) is drafted in-step;
  when the draft batch is empty the verify batch runs as standard SD.

Admission is continuous (at most ``max_num_seqs`` running); finishing uses
``coordinator.finish.apply_finish`` (EOS, stop ids, max_tokens, cut inside an accepted block).

Metrics (as vLLM's spec-decode metrics): ``num_drafts`` = number of (request, verify step) pairs
with k > 0 draft tokens; ``num_accepted_tokens`` = accepted draft tokens over those;
**mean acceptance length** = ``1 + num_accepted_tokens / num_drafts`` = mean number of tokens
committed per verify step per request (1.0 for ``ar``). Throughput is output tokens/s of wall time.
``psd`` also counts its steps and the *parallel* ones (both batches non-empty: one drafted while
the other is verified), the paper's parallel-step ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from coordinator.batch_manager import BatchManager
from coordinator.finish import apply_finish
from specdec.sample.sampling import SamplingParams
from specdec.engine.worker import DraftWorker, StepOutput, TargetWorker

MODES = ("ar", "sd", "psd")


@dataclass(frozen=True)
class LoopConfig:
    """Reference loop settings.

    Attributes:
        mode: one of ``MODES``.
        num_speculative_tokens: k >= 1 (ignored by ``ar``).
        max_num_seqs: running requests at most (>= 1); ``psd`` splits them over two batches.
    """

    mode: str = "sd"
    num_speculative_tokens: int = 4
    max_num_seqs: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass
class Request:
    """One prompt's progress; ``output_token_ids`` holds the emitted tokens only."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_draft_synced: int = 0          # committed tokens the draft worker already knows
    is_speculative: bool = True        # False once the draft KV cannot hold it
    drafts: tuple[list[int], torch.Tensor | None] | None = None   # psd: made at the last step

    @property
    def committed(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class LoopStats:
    """Counters of a run; see the module docstring for the definitions."""

    num_output_tokens: int = 0
    num_verify_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps: int = 0
    num_parallel_steps: int = 0
    elapsed_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class ReferenceLoop:
    """Runs a list of requests to completion with one target and (for sd/psd) one draft worker.

    Args:
        k_of: per-request k (ragged rows): ``k_of(request_id, num_verify_steps_so_far)`` gives
            the k_i in [1, k] a request drafts next; its Draft and Verify calls then hold rows of
            different k_i. None: every request drafts ``cfg.num_speculative_tokens``.

    Raises:
        ValueError: ``sd``/``psd`` without a draft worker.
    """

    def __init__(self, cfg: LoopConfig, target: TargetWorker, drafter: DraftWorker | None = None,
                 k_of: Callable[[str, int], int] | None = None):
        if cfg.mode != "ar" and drafter is None:
            raise ValueError(f"mode {cfg.mode!r} needs a draft worker")
        self.cfg, self.target, self.drafter, self.k_of = cfg, target, drafter, k_of
        self._num_verified: dict[str, int] = {}
        self.stats = LoopStats()
        self._eos_token_ids = target.runner.eos_token_ids
        self._running: dict[str, Request] = {}
        self._batches = BatchManager()

    def run(self, requests: list[Request]) -> LoopStats:
        """Generate every request (in place) and return the run's stats."""
        waiting = list(requests)
        start = time.perf_counter()
        while waiting or self._running:
            admitted = self._admit(waiting)
            if self.cfg.mode == "psd":
                self._batches.assign([r.request_id for r in admitted if not r.finish_reason])
                self._psd_step()
            elif self._running:
                self._sd_step(list(self._running.values()),
                              0 if self.cfg.mode == "ar" else self.cfg.num_speculative_tokens)
        self.stats.elapsed_s += time.perf_counter() - start
        return self.stats

    # ---- admission and finishing -----------------------------------------------------------
    def _admit(self, waiting: list[Request]) -> list[Request]:
        admitted = []
        while waiting and len(self._running) < self.cfg.max_num_seqs:
            request = waiting.pop(0)
            self._running[request.request_id] = request
            first = self.target.add_request(request.request_id, request.prompt_token_ids,
                                            request.params)
            if self.drafter is not None:
                self.drafter.add_request(request.request_id, request.prompt_token_ids,
                                         request.params)
                request.num_draft_synced = len(request.prompt_token_ids)
            self._emit(request, first)
            admitted.append(request)
        return admitted

    def _emit(self, request: Request, step: StepOutput) -> None:
        emitted, reason = apply_finish(step.token_ids, len(request.output_token_ids),
                                       request.params, self._eos_token_ids)
        request.output_token_ids += emitted
        self.stats.num_output_tokens += len(emitted)
        if reason is not None:
            request.finish_reason = str(reason)
            self._finish(request)

    def _finish(self, request: Request) -> None:
        del self._running[request.request_id]
        self.target.release(request.request_id)
        if self.drafter is not None:
            self.drafter.release(request.request_id)
        self._batches.recycle(request.request_id)

    # ---- steps -----------------------------------------------------------------------------
    def _draft(self, requests: list[Request], k: int) -> None:
        """Draft k tokens for the speculative ones among ``requests``; store in ``drafts``."""
        spec = [r for r in requests if r.is_speculative]
        for request in spec:
            if not self.drafter.can_draft(len(request.committed), k):
                request.is_speculative = False    # the draft KV is full: verify with k = 0
        spec = [r for r in spec if r.is_speculative]
        if not spec:
            return
        committed = [(r.num_draft_synced, r.committed[r.num_draft_synced:]) for r in spec]
        ks = [k if self.k_of is None else min(k, self.k_of(r.request_id, self._num_verified.get(r.request_id, 0)))
              for r in spec]
        draft_ids, draft_probs = self.drafter.draft([r.request_id for r in spec], committed, ks)
        for row, request in enumerate(spec):
            request.num_draft_synced = len(request.committed)
            request.drafts = (draft_ids[row], None if draft_probs is None else draft_probs[row])

    def _verify(self, requests: list[Request]) -> None:
        """Verify every request with its stored drafts (k = 0 for those without)."""
        with_drafts = [r for r in requests if r.drafts is not None]
        without = [r for r in requests if r.drafts is None]
        if with_drafts:
            self._verify_group(with_drafts, [r.drafts[0] for r in with_drafts],
                               _stack_probs([r.drafts for r in with_drafts],
                                            self.target.runner.vocab_size))
        if without:
            self._verify_group(without, [[] for _ in without], None)

    def _verify_group(self, requests: list[Request], draft_ids: list[list[int]],
                      draft_probs: torch.Tensor | None) -> None:
        outputs = self.target.verify([r.request_id for r in requests], draft_ids, draft_probs)
        for request, ids, out in zip(requests, draft_ids, outputs):
            request.drafts = None
            self.stats.num_verify_steps += 1
            self._num_verified[request.request_id] = self._num_verified.get(request.request_id, 0) + 1
            if ids:
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += len(ids)
                self.stats.num_accepted_tokens += out.num_accepted
            self._emit(request, out)

    def _sd_step(self, requests: list[Request], k: int) -> None:
        if k > 0:
            self._draft(requests, k)
        self._verify(requests)

    def _psd_step(self) -> None:
        """One MineDraft step (paper §5.1) run in turn: draft ``skip_batch``, verify the other."""
        k = self.cfg.num_speculative_tokens
        self.stats.num_steps += 1
        draft_batch = [self._running[r] for r in self._batches.draft_batch()]
        verify_batch = [self._running[r] for r in self._batches.verify_batch()]
        self._draft([r for r in verify_batch if r.drafts is None], k)   # not drafted yet
        self._draft(draft_batch, k)
        self._verify(verify_batch)
        if draft_batch:
            self.stats.num_parallel_steps += bool(verify_batch)
            self._batches.flip()
        else:                                    # one batch empty: standard SD on the other
            self._batches.mark_started()


def _stack_probs(drafts: list[tuple[list[int], torch.Tensor | None]],
                 vocab_size: int) -> torch.Tensor | None:
    """[b, k, V] draft probs (k = the longest row; zero padding past a row's own width); rows
    drafted greedily (no q) become one-hot on their tokens."""
    if all(q is None for _, q in drafts):
        return None
    rows = [q if q is not None else
            torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.int64), vocab_size).float()
            for ids, q in drafts]
    k = max(row.shape[0] for row in rows)
    return torch.stack([torch.nn.functional.pad(row, (0, 0, 0, k - row.shape[0])) for row in rows])
