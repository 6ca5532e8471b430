"""The postprocess part of a coordinator step: commit what the Verify calls returned, mixed into
the Scheduler through :class:`coordinator.stepping.StepLoop`.

A Verify response holds, per request, its committed block: the accepted draft tokens then one
recovered or bonus token (Leviathan et al. 2023, Algorithm 1), or a plain call's decoded tokens.
Each block goes through the finish rules (``coordinator.finish``: EOS, stop strings and tokens,
``max_tokens``), is streamed to the client and counted; a finished request is retired, freeing
its slot and KV cache. A streamed multi-step call (``VerifyStream``) commits its partial messages
as they arrive (``coordinator.streamed``), the whole response then adds only what they did not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from minedraft.v1 import engine_pb2

from coordinator.adaptive import NO_DRAFT
from coordinator.emitted import Block
from coordinator.finish import apply_finish
from coordinator.request import RequestState, RequestStatus
from coordinator.stats import StepTimes
from coordinator.streamed import StreamedTokens, after_streamed
from coordinator.tracing import Phase


@dataclass
class Committed:
    """What one step committed: tokens emitted, and per verified draft its accepted count and k_i."""

    num_emitted: int = 0
    accepted: list[int] = field(default_factory=list)
    num_spec_tokens: list[int] = field(default_factory=list)


class Postprocess:
    """Commit a step's Verify results (``Scheduler`` provides the state it uses)."""

    def _commit_partial(self, response: engine_pb2.VerifyResponse, streamed: StreamedTokens, named: set[str]) -> None:
        """Commit (and stream) the new tokens of a partial message of a streamed multi-step call;
        a joined request's (not in ``named``) wait for its first token (``EarlyTokens``) and
        count, as its whole-call tokens do, in no step's emitted tokens."""
        for out in response.outputs:
            streamed.add(out.request_id, len(out.token_ids))
            request = self.running.get(out.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished earlier in the call, or aborted
            if out.request_id not in named and self.early_tokens.hold(out):
                continue
            before = len(request.output_token_ids)
            self._commit_output(request, out)
            if out.request_id in named:
                streamed.num_emitted += len(request.output_token_ids) - before

    def _commit_group(self, reqs, drafts, response: engine_pb2.VerifyResponse, verify_rpc_ms: float,
                      times: StepTimes, verify_start_s: float, verify_batch: int, streamed: StreamedTokens,
                      committed: Committed, named: set[str]) -> None:
        """Account one Verify call (times, cost model) and commit its requests' tokens
        (``_postprocess``; past those ``streamed`` committed) into the step's ``committed``;
        ``named``: the request ids of all the step's Verify calls."""
        self._account_verify(reqs, drafts, response, verify_rpc_ms, times, verify_start_s, verify_batch)
        group_emitted, group_accepted, group_ks = self._postprocess(reqs, drafts, response, streamed)
        committed.num_emitted += group_emitted
        committed.accepted += group_accepted if drafts else []
        committed.num_spec_tokens += group_ks if drafts else []
        # requests admitted while the call ran, which decoded in it (vLLM engine): committed
        # once their admission has committed their first token (Scheduler._step_admitting)
        self.joined_outputs += [after_streamed(out, streamed) for out in response.outputs if out.request_id not in named]

    def _account_verify(self, reqs, drafts, response: engine_pb2.VerifyResponse, rpc_ms: float,
                        times: StepTimes, start_s: float, batch: int) -> None:
        """One Verify call's phase and times, and its cost, fitted at the call's widest row (its
        padded width on a GPU)."""
        sent_s = time.time() - rpc_ms / 1e3   # run as the call returns: _commit_group's first work
        times.phases.append(Phase("verifier", batch, start_s, response.verify_ms, rpc_ms, len(reqs),
                                  response.service_ms, sent_s, response.service_start_s,
                                  response.engine_core_ms, response.num_engine_steps))
        times.verify_ms += response.verify_ms
        times.data_plane_ms += response.data_plane_ms
        # verify cost is fitted at the call's widest row (its padded width on a GPU), per decode
        # step when a plain call decoded several (multi-step decoding)
        num_steps = 1 if drafts else max((len(out.token_ids) for out in response.outputs), default=1)
        self.spec_stats.cost.observe_verify(len(reqs), max((len(x.token_ids) for x in drafts or ()), default=NO_DRAFT),
                                            response.verify_ms / max(num_steps, 1))

    def _postprocess(self, verify_reqs, drafts, response: engine_pb2.VerifyResponse,
                     streamed: StreamedTokens) -> tuple[int, list[int], list[int]]:
        """Commit each verified request's tokens (those ``streamed`` did not); returns (tokens
        emitted, accepted count per request, its own k_i per request) for the requests still running."""
        outputs = {out.request_id: out for out in response.outputs}
        row_ks = [len(d.token_ids) for d in drafts] if drafts else [NO_DRAFT] * len(verify_reqs)
        self.spec_stats.observe_call([(r.request_id, k, outputs[r.request_id].num_accepted)  # before retirements
                                      for r, k in zip(verify_reqs, row_ks)
                                      if r.status == RequestStatus.RUNNING and r.request_id in outputs])
        num_emitted, accepted, ks = 0, [], []
        for request, k in zip(verify_reqs, row_ks):
            request.drafts = None
            out = outputs.get(request.request_id)
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if out is None:
                self._retire(request, None, error=(grpc.StatusCode.INTERNAL, "verifier returned no output"))
                continue
            token_ids, logprobs, top = streamed.rest(out)
            if not token_ids and streamed.counts.get(request.request_id):
                continue  # a streamed call's tokens all came in its partial messages
            before, accepted_before = len(request.output_token_ids), request.num_accepted_tokens
            self._commit(request, token_ids, logprobs, k, out.num_accepted, top)
            num_emitted += len(request.output_token_ids) - before
            accepted.append(request.num_accepted_tokens - accepted_before)  # emitted ones only
            ks.append(k)
        return num_emitted, accepted, ks

    def _commit_output(self, request: RequestState, out: engine_pb2.SeqOutput) -> bool:
        """``_commit`` of a plain decode's ``SeqOutput`` (no drafts: k = 0, nothing accepted)."""
        return self._commit(request, list(out.token_ids), list(out.logprobs), 0, 0, list(out.top_logprobs))

    def _commit(self, request: RequestState, token_ids: list[int], logprobs: list[float], k: int,
                num_accepted: int, top_logprobs: list = ()) -> bool:
        """Apply finish rules to a committed block, stream it; returns True if still running.
        ``top_logprobs``: one ``common_pb2.TopLogprobs`` per token when the request asked for them."""
        emitted, reason = apply_finish(token_ids, len(request.output_token_ids), request.finish_params,
                                       self.eos_token_ids)
        num_accepted_emitted = min(num_accepted, len(emitted))
        request.output_token_ids += emitted
        request.num_draft_tokens += k
        request.num_accepted_tokens += num_accepted_emitted
        request.num_drafts += int(k > 0)
        self.emitted.on_block(request, Block(k, num_accepted_emitted, len(emitted)))
        if emitted:
            request.send_chunk(emitted, logprobs[: len(emitted)], k, num_accepted_emitted,
                               top_logprobs[: len(emitted)])
        if reason is not None:
            self._retire(request, reason)
        return reason is None
