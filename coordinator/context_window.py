"""Which requests may speculate this step, given both engines' context windows (torch-free).

A verify step with k draft tokens feeds ``[pending, d_1..d_k]`` on top of the committed sequence
minus its pending token, so the target KV briefly holds ``len(committed) + k`` tokens; drafting k
tokens leaves the draft KV holding ``len(committed) + k - 1`` (docs/ARCHITECTURE.md, Terms).
Near the end of ``max_model_len`` (or when the draft's window is shorter than the target's) a
request no longer has room for k drafts: it continues *without speculation* (a verify with
k = 0, i.e. plain decoding on the target), alone, while the rest of the batch keeps speculating.
A prompt longer than the draft's window is never added to the drafter at all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContextLimits:
    """The engines' ``max_model_len`` (tokens; from ``EngineInfo``); 0 = no limit known.

    Raises:
        ValueError: a negative limit (the message names the field).
    """

    verifier_max_model_len: int = 0
    drafter_max_model_len: int = 0

    def __post_init__(self) -> None:
        for name in ("verifier_max_model_len", "drafter_max_model_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0 = unknown), got {getattr(self, name)}")

    def fits_drafter(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt of that many tokens can be prefilled into the draft KV."""
        return not self.drafter_max_model_len or num_prompt_tokens <= self.drafter_max_model_len

    def can_speculate(self, num_committed_tokens: int, k: int) -> bool:
        """Whether a request with that many committed tokens has room for k draft tokens in both
        the draft KV (``committed + k - 1``) and the target KV during verification (``committed + k``)."""
        is_target_ok = not self.verifier_max_model_len or num_committed_tokens + k <= self.verifier_max_model_len
        is_draft_ok = not self.drafter_max_model_len or num_committed_tokens + k - 1 <= self.drafter_max_model_len
        return is_target_ok and is_draft_ok

    def decode_room(self, num_committed_tokens: int) -> int:
        """Plain decode steps the target KV has room for (each step adds the pending token's KV
        and commits one more; vLLM stops a request at ``max_model_len`` tokens); a large number
        when the limit is unknown."""
        if not self.verifier_max_model_len:
            return 1 << 30
        return self.verifier_max_model_len - num_committed_tokens
