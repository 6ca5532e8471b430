"""Prompt tokenization for the gateway (transformers tokenizer; no torch)."""
from __future__ import annotations

import re
import uuid
from typing import Sequence

from transformers import AutoTokenizer


class PromptTokenizer:
    """The target model's tokenizer, loaded once from a local HF directory.

    Args:
        tokenizer_dir: directory with ``tokenizer.json`` / ``tokenizer_config.json`` (and a chat
            template for ``messages`` requests).

    Not thread-safe: ``encode(split_special_tokens=...)`` mutates the Rust tokenizer's
    ``encode_special_tokens`` flag, so concurrent encodes (or an encode racing a decode) could
    tokenize a chat template's special tokens as text or fail with "Already borrowed". The
    gateway calls it from its event-loop thread only (a prompt encodes in about a millisecond;
    ``gateway.validation`` refuses text too long to fit before it gets here, see ``max_token_bytes``).

    Attributes:
        vocab_size: number of token ids.
        max_token_bytes: most UTF-8 bytes the text of one token spans (a token ending inside a
            character decodes to U+FFFD and counts 3), so text of ``n`` bytes has at least
            ``n / max_token_bytes`` tokens. SmolLM2: 81.

    Raises:
        OSError: the directory holds no loadable tokenizer.
    """

    def __init__(self, tokenizer_dir: str) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.vocab_size: int = len(self._tokenizer)
        self.max_token_bytes: int = _max_token_bytes(self._tokenizer)
        self.has_chat_template: bool = bool(getattr(self._tokenizer, "chat_template", None))
        self._special_ids = {t.content: i for i, t in self._tokenizer.added_tokens_decoder.items() if t.special}
        self._special_re = _alternation(self._special_ids)

    @property
    def hf_tokenizer(self):
        """The wrapped transformers tokenizer (for decoding)."""
        return self._tokenizer

    def encode_text(self, text: str) -> list[int]:
        """Tokenizes raw text. Text that looks like a special token (e.g. ``<|im_end|>``) is
        tokenized as ordinary text (``split_special_tokens=True``), never as the special token."""
        return list(self._tokenizer.encode(text, add_special_tokens=True, split_special_tokens=True))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Renders ``messages`` with the chat template (``add_generation_prompt=True``) and
        tokenizes the result. Only the template's own markup yields special tokens: message content
        is tokenized as text, like ``encode_text`` (``<|im_end|>`` in a user message is text, so a
        user cannot close their turn and inject a system turn; issue 25.5).

        How: every special-token text in the content is swapped for a one-off placeholder before
        rendering, so the rendered string holds special-token text only where the template put it.
        It is then cut at those special tokens (as the tokenizer itself does) and each run between
        them, placeholders restored, is tokenized as text. Content without special-token text
        takes the tokenizer's own path (``encode(rendered)``), which gives the same ids.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError("the served model's tokenizer has no chat template")
        hidden: list[str] = []
        marker = f"MDSPECIAL{uuid.uuid4().hex}N"
        safe = [{**m, "content": self._hide_specials(m["content"], marker, hidden)} for m in messages]
        rendered = self._tokenizer.apply_chat_template(safe, add_generation_prompt=True, tokenize=False)
        if not hidden:
            return list(self._tokenizer.encode(rendered, add_special_tokens=False))
        restore = re.compile(re.escape(marker) + r"(\d+)X")
        ids: list[int] = []
        for i, piece in enumerate(self._special_re.split(rendered)):
            if i % 2:  # a special token of the template's markup
                ids.append(self._special_ids[piece])
            elif piece:
                ids += self.encode_text_run(restore.sub(lambda m: hidden[int(m.group(1))], piece))
        return ids

    def _hide_specials(self, content: str, marker: str, hidden: list[str]) -> str:
        """``content`` with each special-token text replaced by ``marker<i>X`` (appended to ``hidden``)."""
        if self._special_re is None:
            return content

        def hide(match: re.Match) -> str:
            hidden.append(match.group())
            return f"{marker}{len(hidden) - 1}X"

        return self._special_re.sub(hide, content)

    def encode_text_run(self, text: str) -> list[int]:
        """Tokenizes ``text`` as text (special-token text too), without BOS/EOS."""
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decodes token ids to text."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _alternation(texts) -> re.Pattern | None:
    """A regex matching any of ``texts`` (longest first, captured), or None when there are none."""
    ordered = sorted(texts, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")") if ordered else None


def _max_token_bytes(tokenizer) -> int:
    """Most UTF-8 bytes of one token's decoded text, over the whole vocabulary (~0.6 s for 49152 ids)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return max(1, max(len(text.encode("utf-8", "surrogatepass")) for text in texts))
