"""Per-request output state of the gateway: detokenization, stop strings, usage (torch-free)."""
from __future__ import annotations

from minedraft.v1 import common_pb2, coordinator_pb2, generate_pb2

from gateway.detokenizer import Decoder, IncrementalDetokenizer, StopMatch, StopStringChecker

FINISH_STOP = "stop"


class RequestOutput:
    """Turns the coordinator's token chunks of one request into public GenerateChunks.

    One GenerateChunk is produced per coordinator TokenChunk (one per engine step), so a
    client may count steps. Text is streamed as soon as it is complete UTF-8 and cannot be
    the start of a stop string (see ``gateway.detokenizer``).

    Args:
        tokenizer: the target model's tokenizer (``decode``).
        prompt_token_ids: the prompt, ``[prompt_len]``.
        stops: stop strings; ``include_stop_str_in_output`` keeps a matched one in the text.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stops: tuple[str, ...],
                 include_stop_str_in_output: bool) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._checker = StopStringChecker(stops, include_stop_str_in_output)
        self._num_prompt_tokens = len(prompt_token_ids)
        self._num_sent_chars = 0
        self.output_token_ids: list[int] = []
        self.stop_match: StopMatch | None = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts = 0

    @property
    def text(self) -> str:
        """The output text so far (cut at the stop string once one matched)."""
        text = self._detokenizer.text
        return text[:self.stop_match.text_end] if self.stop_match else text

    @property
    def is_stopped(self) -> bool:
        """True once a stop string matched: the request must be aborted at the coordinator."""
        return self.stop_match is not None

    def _add_tokens(self, token_ids) -> int:
        """Feeds tokens one by one, stopping at the token that completes a stop string.
        Returns how many of ``token_ids`` belong to the output."""
        for i, token_id in enumerate(token_ids):
            delta = self._detokenizer.add_token(token_id)
            self.output_token_ids.append(int(token_id))
            self.stop_match = self._checker.find(self._detokenizer.text, len(delta))
            if self.stop_match:
                return i + 1
        return len(token_ids)

    def _take_text(self, is_finished: bool) -> str:
        text = self.text
        end = self._checker.num_streamable_chars(text, is_finished or self.is_stopped)
        delta = text[self._num_sent_chars:end]
        self._num_sent_chars = max(self._num_sent_chars, end)
        return delta

    def on_chunk(self, chunk: coordinator_pb2.TokenChunk) -> generate_pb2.GenerateChunk:
        """Processes one engine step's committed tokens; returns the public chunk."""
        num_kept = self._add_tokens(list(chunk.token_ids))
        self.num_draft_tokens += chunk.num_draft_tokens
        # a stop string cut the block: only its first num_kept tokens were emitted, and its
        # accepted draft tokens come first (then the recovered or bonus token)
        self.num_accepted_tokens += min(chunk.num_accepted_tokens, num_kept)
        if chunk.num_draft_tokens > 0:
            self.num_drafts += 1
        return generate_pb2.GenerateChunk(
            token_ids=list(chunk.token_ids)[:num_kept],
            text=self._take_text(is_finished=False),
            logprobs=list(chunk.logprobs)[:num_kept],
            top_logprobs=list(chunk.top_logprobs)[:num_kept],
        )

    def on_finish(self) -> str:
        """At finish: flushes held-back text (incomplete characters, stop-string hold-back);
        returns the text not streamed yet."""
        if not self.is_stopped:
            delta = self._detokenizer.flush()
            self.stop_match = self._checker.find(self._detokenizer.text, len(delta))
        return self._take_text(is_finished=True)

    def usage(self, reported: common_pb2.Usage | None) -> common_pb2.Usage:
        """Usage of the request: the coordinator's report when given (finished normally),
        else counted here from the chunks; ``num_drafts`` is always counted here."""
        usage = common_pb2.Usage(
            prompt_tokens=self._num_prompt_tokens,
            completion_tokens=len(self.output_token_ids),
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )
        if reported is not None and not self.is_stopped:
            usage.CopyFrom(reported)
        usage.num_drafts = self.num_drafts
        return usage

    def complete(self, finish_reason: str, reported: common_pb2.Usage | None) -> generate_pb2.GenerateComplete:
        """The final message of the stream."""
        return generate_pb2.GenerateComplete(
            output_token_ids=self.output_token_ids,
            text=self.text,
            finish_reason=FINISH_STOP if self.is_stopped else finish_reason,
            usage=self.usage(reported),
        )
