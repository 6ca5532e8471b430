"""Admission capacity over both engines: the verifier's and the drafter's KV slots (torch-free).

The MineDraft paper's vLLM plugin admits by the target's KV blocks alone; the drafter keeps KV for
every resident request too (2m of them in ``psd``), so a drafter with less room fails mid-traffic.
Here both engines preallocate one KV slot of ``max_model_len`` tokens per request
(``specdec.kv.kv_cache``; start-up checks the memory of both, ``minedraft.capacity``), report their
free slots in ``EngineInfo.num_free_slots``, and the coordinator admits at most what *both* hold:
``min(2m or m, verifier slots, drafter slots)`` (the drafter counts in every mode that drafts:
``sd``, ``psd``, ``auto``). Context windows (``max_model_len``) are handled per request by
``coordinator.context_window``.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config import CoordinatorConfig

NO_DRAFTER = 0  # num_drafter_slots when the mode does not use the drafter


def num_within_token_budget(prompt_lens: list[int], max_num_batched_tokens: int) -> int:
    """How many requests from the queue's head (prompt lengths in tokens, in queue order) fit
    one admission of at most ``max_num_batched_tokens`` prompt tokens; the head always counts,
    so a prompt longer than the budget is admitted alone. 0 (``NO_TOKEN_BUDGET``): all of them.
    """
    if max_num_batched_tokens <= 0:
        return len(prompt_lens)
    num, total = 0, 0
    for length in prompt_lens:
        if num and total + length > max_num_batched_tokens:
            break
        num, total = num + 1, total + length
    return num


@dataclass(frozen=True)
class EngineSlots:
    """Free KV slots each engine reported at start.

    Attributes:
        num_verifier_slots: the verifier's (>= 1).
        num_drafter_slots: the drafter's (>= 1 when it is used), or :data:`NO_DRAFTER`.

    Raises:
        ValueError: a count out of range (the message names the field).
    """

    num_verifier_slots: int
    num_drafter_slots: int = NO_DRAFTER

    def __post_init__(self) -> None:
        if self.num_verifier_slots < 1:
            raise ValueError(f"num_verifier_slots: the verifier reports no free KV slot ({self.num_verifier_slots})")
        if self.num_drafter_slots < 0:
            raise ValueError(f"num_drafter_slots: must be >= 0, got {self.num_drafter_slots}")

    def max_num_running(self, cfg: CoordinatorConfig) -> int:
        """Requests admitted at most: the mode's cap (2m / m) and every used engine's slots.

        Raises:
            ValueError: the mode drafts but the drafter reports no free slot.
        """
        if cfg.uses_drafter and self.num_drafter_slots < 1:
            raise ValueError(f"num_drafter_slots: the drafter reports no free KV slot ({self.num_drafter_slots})")
        caps = [cfg.max_num_running, self.num_verifier_slots]
        return min(caps + ([self.num_drafter_slots] if cfg.uses_drafter else []))

    def limited_by(self, cfg: CoordinatorConfig) -> str:
        """Which bound sets :meth:`max_num_running`: "config", "verifier" or "drafter"."""
        cap = self.max_num_running(cfg)
        if cap == cfg.max_num_running:
            return "config"
        return "verifier" if cap == self.num_verifier_slots else "drafter"
