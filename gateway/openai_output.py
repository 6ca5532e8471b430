"""OpenAI-shaped response bodies built from the public ``GenerateResponse`` stream (torch-free).

The gateway's gRPC stream already carries the detokenized text deltas, the target model's
logprobs and the usage; this module only reshapes them into OpenAI JSON:

- ``/v1/completions``: ``text_completion`` objects; logprobs as ``{tokens, token_logprobs,
  top_logprobs: [{token: logprob}], text_offset}``.
- ``/v1/chat/completions``: ``chat.completion`` / ``chat.completion.chunk`` objects; logprobs as
  ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
- ``usage``: prompt_tokens, completion_tokens, total_tokens and the ``minedraft`` extension
  (num_draft_tokens, num_accepted_tokens, num_drafts, mean_acceptance_length = 1 + accepted /
  drafts, null without drafts). With ``n`` > 1 the prompt is counted once and the rest is summed
  over the returned choices.
- ``n`` > 1: one choice per ``index`` (the chunks' and completes' ``index``); stream chunks carry it.

Token strings are ``tokenizer.decode([token_id])`` (as vLLM does), so a token holding part of a
multi-byte character shows U+FFFD.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from minedraft.v1 import common_pb2, generate_pb2

CHAT = "chat"
COMPLETION = "completion"
_OBJECTS = {CHAT: ("chat.completion", "chat.completion.chunk"), COMPLETION: ("text_completion", "text_completion")}
_ID_PREFIXES = {CHAT: "chatcmpl-", COMPLETION: "cmpl-"}


def summed_usage(usages: list[common_pb2.Usage]) -> common_pb2.Usage:
    """One usage for several choices of one prompt: the prompt once, everything else summed."""
    total = common_pb2.Usage(prompt_tokens=usages[0].prompt_tokens if usages else 0)
    for usage in usages:
        total.completion_tokens += usage.completion_tokens
        total.num_draft_tokens += usage.num_draft_tokens
        total.num_accepted_tokens += usage.num_accepted_tokens
        total.num_drafts += usage.num_drafts
    return total


@dataclass
class _ChoiceState:
    """Per-choice state: completions' text offset, accumulated logprobs, first stream chunk."""

    text_offset: int = 0
    logprobs: list[dict] = field(default_factory=list)  # chat: content entries; completion: per-token dicts
    is_first_chunk: bool = True


def usage_dict(usage: common_pb2.Usage) -> dict:
    """OpenAI ``usage`` plus the ``minedraft`` speculative-decoding extension."""
    mean_acceptance_length = 1 + usage.num_accepted_tokens / usage.num_drafts if usage.num_drafts else None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "minedraft": {
            "num_draft_tokens": usage.num_draft_tokens,
            "num_accepted_tokens": usage.num_accepted_tokens,
            "num_drafts": usage.num_drafts,
            "mean_acceptance_length": mean_acceptance_length,
        },
    }


class OpenAIOutput:
    """Reshapes one request's GenerateResponses into OpenAI JSON (one instance per request).

    Args:
        kind: ``CHAT`` or ``COMPLETION``.
        request_id: the gateway request id (response ``id`` is ``chatcmpl-``/``cmpl-`` + it).
        model: the served model id.
        decode: token id -> token string.
        is_logprobs: the client asked for logprobs (chat ``logprobs: true``; completions
            ``logprobs`` set, 0 included).
    """

    def __init__(self, kind: str, request_id: str, model: str, decode: Callable[[int], str],
                 is_logprobs: bool) -> None:
        if kind not in _OBJECTS:
            raise ValueError(f"kind: must be {CHAT!r} or {COMPLETION!r}, got {kind!r}")
        self.kind = kind
        self.id = _ID_PREFIXES[kind] + request_id
        self.model = model
        self.created = int(time.time())
        self._decode = decode
        self._is_logprobs = is_logprobs
        self._choices: dict[int, _ChoiceState] = {}

    def _state(self, index: int) -> _ChoiceState:
        return self._choices.setdefault(index, _ChoiceState())

    def _chat_entry(self, state: _ChoiceState, token_id: int, logprob: float,
                    top: common_pb2.TopLogprobs | None) -> dict:
        token = self._decode(token_id)
        alternatives = [] if top is None else [
            {"token": (t := self._decode(i)), "logprob": lp, "bytes": list(t.encode())}
            for i, lp in zip(top.token_ids, top.logprobs)]
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": alternatives}

    def _completion_entry(self, state: _ChoiceState, token_id: int, logprob: float,
                          top: common_pb2.TopLogprobs | None) -> dict:
        token = self._decode(token_id)
        entry = {"token": token, "logprob": logprob, "text_offset": state.text_offset,
                 "top": None if top is None else {self._decode(i): lp for i, lp in zip(top.token_ids, top.logprobs)}}
        state.text_offset += len(token)
        return entry

    def _entries(self, chunk: generate_pb2.GenerateChunk) -> list[dict]:
        if not self._is_logprobs:
            return []
        make = self._chat_entry if self.kind == CHAT else self._completion_entry
        state, tops = self._state(chunk.index), list(chunk.top_logprobs)
        return [make(state, t, lp, tops[i] if i < len(tops) else None)
                for i, (t, lp) in enumerate(zip(chunk.token_ids, chunk.logprobs))]

    def _logprobs_json(self, entries: list[dict]) -> dict | None:
        if not self._is_logprobs:
            return None
        if self.kind == CHAT:
            return {"content": entries, "refusal": None}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries] if any(e["top"] is not None for e in entries) else None,
                "text_offset": [e["text_offset"] for e in entries]}

    def _choice(self, index: int, text: str, entries: list[dict] | None, finish_reason: str | None,
                is_delta: bool) -> dict:
        choice: dict = {"index": index}
        state = self._state(index)
        if self.kind == CHAT and is_delta:
            choice["delta"] = {"role": "assistant", "content": text} if state.is_first_chunk else {"content": text}
            state.is_first_chunk = False
        elif self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        choice["logprobs"] = None if entries is None else self._logprobs_json(entries)
        choice["finish_reason"] = finish_reason
        return choice

    def _envelope(self, choices: list[dict], is_chunk: bool, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": _OBJECTS[self.kind][int(is_chunk)], "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None or not is_chunk:
            body["usage"] = usage
        return body

    # ---------------------------------------------------------------- streaming
    def chunk_json(self, chunk: generate_pb2.GenerateChunk) -> dict | None:
        """The stream event of one engine step's chunk; None when it carries nothing to send
        (no text yet and no logprobs wanted)."""
        entries = self._entries(chunk)
        if not chunk.text and not entries:
            return None
        return self._envelope([self._choice(chunk.index, chunk.text, entries if entries else None, None, True)], True)

    def finish_chunk_json(self, complete: generate_pb2.GenerateComplete) -> dict:
        """The stream event carrying one choice's finish_reason."""
        return self._envelope([self._choice(complete.index, "", None, complete.finish_reason, True)], True)

    def usage_chunk_json(self, completes: list[generate_pb2.GenerateComplete]) -> dict:
        """The stream's last event when usage was asked for: no choices, the summed usage."""
        return self._envelope([], True, usage_dict(summed_usage([c.usage for c in completes])))

    # ------------------------------------------------------------ non-streaming
    def add_chunk(self, chunk: generate_pb2.GenerateChunk) -> None:
        """Accumulates a chunk's logprobs for ``response_json``."""
        self._state(chunk.index).logprobs += self._entries(chunk)

    def response_json(self, completes: list[generate_pb2.GenerateComplete]) -> dict:
        """The whole (non-streaming) response: one choice per complete, by index."""
        choices = []
        for complete in sorted(completes, key=lambda c: c.index):
            entries = self._state(complete.index).logprobs[:len(complete.output_token_ids)]
            choices.append(self._choice(complete.index, complete.text, entries, complete.finish_reason, False))
        return self._envelope(choices, False, usage_dict(summed_usage([c.usage for c in completes])))
