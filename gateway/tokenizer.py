"""Prompt tokenization for the gateway (transformers tokenizer; no torch)."""
from __future__ import annotations

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
        tokenizes the result; the template's own special tokens are parsed as special tokens.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError("the served model's tokenizer has no chat template")
        rendered = self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False)
        return list(self._tokenizer.encode(rendered, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decodes token ids to text."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _max_token_bytes(tokenizer) -> int:
    """Most UTF-8 bytes of one token's decoded text, over the whole vocabulary (~0.6 s for 49152 ids)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return max(1, max(len(text.encode("utf-8", "surrogatepass")) for text in texts))
