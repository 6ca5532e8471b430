"""Tokens a step's streamed multi-step Verify call committed before the call ended (torch-free).

With ``CoordinatorConfig.stream_decode_steps`` an ``ar`` step's multi-step call is a
``Verifier.VerifyStream``: its partial messages carry each named row's new tokens as the
verifier's steps decode them, and the coordinator commits (and streams) them at once, so a
request that finishes inside the call ends then. The call's last message is the whole call, as
``Verify`` returns it; the step commits from it only what no partial message brought
(:meth:`StreamedTokens.rest`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
