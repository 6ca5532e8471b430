"""Engine error classes shared by the runner, loader and workers."""

from __future__ import annotations


class MineDraftEngineError(Exception):
    """Base class of all specdec engine errors."""


class CapacityError(MineDraftEngineError):
    """No free KV-cache slot, or a sequence would exceed ``max_model_len`` tokens.

    Callers (workers, services) map it to gRPC ``RESOURCE_EXHAUSTED``.
    """


class IncompatibleDraftError(MineDraftEngineError):
    """The draft model's tokenizer does not match the target model's tokenizer.

    Speculative decoding (Leviathan et al. 2023, Sec. 2) compares draft and target
    probabilities token id by token id, so both models must map shared tokens to the
    same ids.
    """
