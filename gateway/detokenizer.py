"""Incremental detokenization and stop-string detection (torch-free).

The algorithm follows vLLM's incremental detokenizer (``vllm/transformers_utils/detokenizer_utils.py``,
``detokenize_incrementally``): the output is decoded in a sliding window of tokens
``[prefix_offset, len)``; the text already emitted for ``[prefix_offset, read_offset)`` is
subtracted, so a token is re-decoded together with its left context (byte-level BPE merges and
SentencePiece leading spaces come out right). When the window's text ends with U+FFFD, the last
token ends inside a multi-byte UTF-8 character, so nothing is emitted until a later token
completes it: the streamed deltas never contain broken characters.

Stop strings follow vLLM V1 (``vllm/v1/engine/detokenizer.py``): each new delta is searched
together with the last ``len(stop) - 1`` characters before it, so a stop string split across two
steps is found; while stop strings are set, the last ``max(len(stop)) - 1`` characters are held
back from streaming so that a delta never contains the first half of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Tokens of left context re-decoded with each new token (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
NUM_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a transformers tokenizer the detokenizer needs."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas without broken UTF-8.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        prompt_token_ids: the last few prompt tokens give the first output tokens their left
            context (leading-space handling); only ``NUM_CONTEXT_TOKENS`` of them are kept.
        skip_special_tokens: drop special tokens (e.g. EOS) from the text, as vLLM does by default.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids)[-NUM_CONTEXT_TOKENS:]
        self._token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Appends one token id; returns the newly decodable text ("" while a character is incomplete)."""
        self._token_ids.append(int(token_id))
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At finish: returns the text still held back (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self.text += delta
        return delta


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string was found: the output text ends at ``text_end`` (characters)."""

    stop: str
    text_end: int


@dataclass
class StopStringChecker:
    """Finds stop strings in a growing text and decides how much of it may be streamed.

    Args:
        stops: the request's stop strings (non-empty strings).
        include_stop_str_in_output: keep the stop string in the output text (vLLM semantics).
    """

    stops: tuple[str, ...]
    include_stop_str_in_output: bool = False
    max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        if any(not s for s in self.stops):
            raise ValueError("stops: stop strings must be non-empty")
        self.max_stop_len = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, num_new_chars: int) -> StopMatch | None:
        """Searches the last ``num_new_chars`` characters of ``text`` (plus the overlap a stop
        string split across steps needs) and returns the earliest match, or None."""
        if not self.stops or num_new_chars <= 0:
            return None
        best: StopMatch | None = None
        for stop in self.stops:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index < 0:
                continue
            end = index + len(stop) if self.include_stop_str_in_output else index
            if best is None or end < best.text_end:
                best = StopMatch(stop=stop, text_end=end)
        return best

    def num_streamable_chars(self, text: str, is_finished: bool) -> int:
        """How many leading characters of ``text`` may be streamed now (the rest is held back
        because it might be the start of a stop string)."""
        if is_finished or not self.stops or self.include_stop_str_in_output:
            return len(text)
        return max(0, len(text) - (self.max_stop_len - 1))
