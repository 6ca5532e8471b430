"""vLLM outputs -> the engine seam's types (``StepOutput``, ``EngineFacts``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.engine_api import EngineFacts
from specdec.engine.worker_base import StepOutput


def collect_step(request_outputs) -> dict:
    """{request id (the one given to ``add_request``): ``CompletionOutput`` delta} of one
    ``LLMEngine.step()``; requests without new tokens are absent."""
    return {out.request_id: out.outputs[0] for out in request_outputs if out.outputs}


@dataclass
class CoreOutput:
    """One request's part of one engine-core step, as ``core_step`` reads it: what ``StepDelta``,
    ``step_output`` and ``RowEnds`` read of vLLM's ``CompletionOutput`` delta.

    Attributes:
        token_ids: the tokens sampled in this step (``[n]``, n >= 0).
        logprobs: None (none asked), else per token {token id: ``vllm.logprobs.Logprob``}: the
            sampled token with its rank, then the ``num_logprobs`` most likely with ranks 1..n.
        finish_reason: vLLM's (``"length"``, ``"stop"``, ``"abort"``) once the request ended.
    """

    token_ids: list[int]
    logprobs: list[dict] | None = None
    finish_reason: str | None = None

    def after_first(self) -> "CoreOutput":
        """This step's delta without its first token (a joined request's, which its join answered)."""
        return CoreOutput(self.token_ids[1:], None if self.logprobs is None else self.logprobs[1:], self.finish_reason)


@dataclass
class CoreTime:
    """One call's engine steps and their time in vLLM's engine core (``core_step``: schedule, run,
    update; under async scheduling also the wait for the GPU). The call's wall time beyond
    ``ms`` is the worker's own per-step work (step hook, row ends, joins, outputs)."""

    ms: float = 0.0
    num_steps: int = 0

    def add(self, seconds: float) -> None:
        self.ms += seconds * 1e3
        self.num_steps += 1


def core_step(engine, names: dict) -> dict:
    """{request id (ours): ``CoreOutput``} of one step of ``engine``'s engine core, read from
    ``engine.engine_core.get_output()`` instead of ``LLMEngine.step()``: vLLM's output processor,
    which builds a ``RequestOutput`` per row per step, stays off the engine thread (0.13 ms of a
    step at 16 rows, 0.44 at 64 on a 2-core CPU; vLLM's server runs it in its API process, beside
    the engine core). Its request states stay until the request is aborted (``release``).

    Args:
        engine: an in-process ``LLMEngine``.
        names: vLLM's internal request id -> (ours, the number of top logprobs it asked: -1 none,
            0 the sampled token's only); outputs of other ids are dropped.

    Returns:
        The requests that got tokens or ended in this step.
    """
    out = {}
    for o in engine.engine_core.get_output().outputs:
        name = names.get(o.request_id)
        if name is None or not (o.new_token_ids or o.finish_reason is not None):
            continue
        rid, num_logprobs = name
        logprobs = None if o.new_logprobs is None else _logprob_dicts(o.new_logprobs, max(num_logprobs, 0))
        out[rid] = CoreOutput(list(o.new_token_ids), logprobs, None if o.finish_reason is None else str(o.finish_reason))
    return out


def _logprob_dicts(lists, num_logprobs: int) -> list[dict]:
    """vLLM's ``LogprobsLists`` of one request (rows: its new tokens; columns: the sampled token,
    then the batch's most likely tokens) -> per token the dict its output processor builds
    (``vllm.logprobs.append_logprobs_for_next_position``), without decoded tokens."""
    from vllm.logprobs import Logprob

    dicts = []
    for token_ids, values, rank in zip(lists.logprob_token_ids.tolist(), lists.logprobs.tolist(),
                                       lists.sampled_token_ranks.tolist()):
        ranks = (rank, *range(1, num_logprobs + 1))
        dicts.append({tid: Logprob(logprob=lp, rank=r) for tid, lp, r in zip(token_ids, values, ranks)})
    return dicts


@dataclass
class StepDelta:
    """One request's per-step deltas (``CoreOutput``) of one call, merged: the tokens and their
    logprobs in order, how many model steps gave tokens, vLLM's finish reason if it ended."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    num_steps: int = 0
    finish_reason: str | None = None

    def add(self, output) -> None:
        """Append one step's delta (``CoreOutput``)."""
        self.token_ids += output.token_ids
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(output.logprobs)
        self.num_steps += 1
        self.finish_reason = output.finish_reason or self.finish_reason

    def first(self) -> "StepDelta":
        """The first token's delta (a joined request's answer to its join: the tokens after it
        go back with the call, ``after_first``)."""
        return StepDelta(self.token_ids[:1], None if self.logprobs is None else self.logprobs[:1],
                         min(self.num_steps, 1), self.finish_reason if len(self.token_ids) == 1 else None)

    def after_first(self) -> "StepDelta":
        """The deltas without their first token (a joined request's, whose first token went
        back with its join)."""
        return StepDelta(self.token_ids[1:], None if self.logprobs is None else self.logprobs[1:],
                         max(self.num_steps - 1, 0), self.finish_reason)


def step_output(request_id: str, output, num_draft_tokens: int, num_top: int) -> StepOutput:
    """``StepOutput`` of one request's step: the committed tokens (accepted drafts then one
    recovered or bonus token), ``num_accepted = len - 1`` when drafts were verified, the raw
    logprob of each token and its ``num_top`` most likely alternatives (vLLM's ranks); no
    logprobs at all when ``num_top`` is ``NO_LOGPROBS`` (-1)."""
    token_ids = list(output.token_ids)
    logprobs, top = [], []
    if output.logprobs is None and num_top < 0:   # NO_LOGPROBS: none asked, none computed
        return StepOutput(request_id, token_ids, _num_accepted(token_ids, num_draft_tokens), [], [])
    for token_id, candidates in zip(token_ids, output.logprobs or [{}] * len(token_ids)):
        chosen = candidates.get(token_id)
        logprobs.append(chosen.logprob if chosen is not None else math.nan)
        if num_top > 0:
            ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in candidates.items() if lp.rank <= num_top)
            top.append(([tid for _, tid, _ in ranked], [value for _, _, value in ranked]))
    return StepOutput(request_id, token_ids, _num_accepted(token_ids, num_draft_tokens), logprobs, top)


def _num_accepted(token_ids: list[int], num_draft_tokens: int) -> int:
    return min(len(token_ids) - 1, num_draft_tokens) if num_draft_tokens else 0


def engine_facts(engine, cfg) -> EngineFacts:
    """What ``EngineInfo`` reports of a vLLM engine built from ``cfg``."""
    model_config = engine.vllm_config.model_config
    parallel = engine.vllm_config.parallel_config
    hf = model_config.hf_config
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    from specdec.models.footprint import DTYPE_BYTES

    dtype_bytes = DTYPE_BYTES[cfg.dtype]
    per_token = (2 * model_config.get_num_layers(parallel) * model_config.get_num_kv_heads(parallel)
                 * model_config.get_head_size() * dtype_bytes)
    cache = engine.vllm_config.cache_config
    vocab = int(model_config.get_vocab_size())
    return EngineFacts(
        vocab_size=vocab, input_vocab_size=vocab, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
        num_free_slots=cfg.max_num_seqs, eos_token_ids=eos_ids, device=cfg.device, dtype=cfg.dtype,
        weight_bytes=_weight_bytes(cfg.model, dtype_bytes) if cfg.load_format != "dummy" else 0,
        kv_cache_bytes=int(cache.num_gpu_blocks) * int(cache.block_size) * per_token)


def _weight_bytes(model_dir: str, dtype_bytes: int) -> int:
    """Parameters in the dir's safetensors files x bytes per parameter (0 when there are none)."""
    from specdec.models.footprint import num_safetensors_params

    try:
        return num_safetensors_params(model_dir)[0] * dtype_bytes
    except (OSError, ValueError):
        return 0


def streamer(named: list[tuple[str, int]], on_step, num_top_of):
    """``VllmTargetWorker._run``'s per-engine-step hook for a streamed call: {request id: one
    step's ``CoreOutput``} and the ids whose part ended in it -> ``on_step`` with the rows'
    ``StepOutput``s: the named rows' (``named``: (request id, top logprobs asked) per named row,
    in order), then those of requests that joined the call, without a joined request's first
    token (its join's answer, ``JoiningCallsMixin``), so that what streams of a joined row is
    what the call's response returns of it (``StepDelta.after_first``). ``num_top_of``: request
    id -> top logprobs asked (-1: none) of a joined request."""
    named_ids = {rid for rid, _ in named}
    first_seen: set[str] = set()   # joined rows whose first token went by

    def hook(outputs: dict, final: set[str]) -> None:
        steps = [step_output(rid, outputs[rid], 0, num_top) for rid, num_top in named
                 if rid in outputs and outputs[rid].token_ids]
        for rid, output in outputs.items():
            if rid in named_ids or not output.token_ids:
                continue
            if rid not in first_seen:
                first_seen.add(rid)
                output = output.after_first()
            if output.token_ids:
                steps.append(step_output(rid, output, 0, num_top_of(rid)))
        for out in steps:
            out.is_final = out.request_id in final
        if steps:
            on_step(steps)
    return hook
