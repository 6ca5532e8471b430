"""Tokens a step's streamed multi-step Verify call committed before the call ended (torch-free).

With ``CoordinatorConfig.stream_decode_steps`` an ``ar`` step's multi-step call is a
``Verifier.VerifyStream``: its partial messages carry each named row's new tokens as the
verifier's steps decode them, and the coordinator commits (and streams) them at once, so a
request that finishes inside the call ends then. The call's last message is the whole call, as
``Verify`` returns it; the step commits from it only what no partial message brought
(:meth:`StreamedTokens.rest`).

With the vLLM engine a request admitted while an ``ar`` call runs joins it (its prefill between
two of the call's steps; ``AddRequests`` answers with its first token) and decodes in it; the
partial messages carry its tokens after the first too (``VerifyRequest.stream_joined``). They may
come before its ``AddRequests`` answer (two RPCs), so :class:`EarlyTokens` holds them until the
admission has committed the first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minedraft.v1 import engine_pb2


@dataclass
class StreamedTokens:
    """Per request id, how many of this step's tokens the partial messages brought; and how many
    of them were emitted (finish rules applied)."""

    counts: dict[str, int] = field(default_factory=dict)
    num_emitted: int = 0

    def add(self, request_id: str, num_tokens: int) -> None:
        self.counts[request_id] = self.counts.get(request_id, 0) + num_tokens

    def rest(self, output) -> tuple[list[int], list[float], list]:
        """(token ids, logprobs, top logprobs) of a whole-call ``SeqOutput`` after the tokens
        streamed already."""
        skip = self.counts.get(output.request_id, 0)
        return list(output.token_ids[skip:]), list(output.logprobs[skip:]), list(output.top_logprobs[skip:])


class EarlyTokens:
    """Streamed tokens of requests whose admission still waits for its first token (see the
    module docstring): held per request id in arrival order, handed back once the first token
    is committed (:meth:`take`), dropped with a failed or aborted admission."""

    def __init__(self) -> None:
        self._prefilling: set[str] = set()
        self._held: dict[str, list[engine_pb2.SeqOutput]] = {}

    def start(self, request_ids) -> None:
        """The admission of ``request_ids`` sent their prefill."""
        self._prefilling.update(request_ids)

    def hold(self, output: engine_pb2.SeqOutput) -> bool:
        """Hold ``output`` if its request's first token has not come yet; False: commit it now."""
        if output.request_id not in self._prefilling:
            return False
        self._held.setdefault(output.request_id, []).append(output)
        return True

    def take(self, request_id: str) -> list[engine_pb2.SeqOutput]:
        """The admission of ``request_id`` ended (first token committed, or failed): what was
        held for it, in order; later outputs are committed at once."""
        self._prefilling.discard(request_id)
        return self._held.pop(request_id, [])


def after_streamed(output: engine_pb2.SeqOutput, streamed: StreamedTokens) -> engine_pb2.SeqOutput:
    """``output`` (a joined request's part of a whole-call response) without the tokens the
    call's partial messages brought."""
    token_ids, logprobs, top = streamed.rest(output)
    return engine_pb2.SeqOutput(request_id=output.request_id, token_ids=token_ids, logprobs=logprobs,
                                top_logprobs=top)
