"""``ExternalDraftProposer``: the ``custom_class`` speculative proposer of the vLLM verifier.

vLLM's ``speculative_config`` with ``method="custom_class"`` and ``model=
"specdec.vllm_backend.proposer.ExternalDraftProposer"`` turns on speculative decoding in the
target engine (the rejection sampler, ``k + 1`` positions per request) without a draft model
inside it: the draft tokens are made by the drafter service and reach the engine through
``PsdScheduler`` before each step. So this proposer proposes nothing; vLLM calls it after
every step and gets an empty draft for every request.
"""

from __future__ import annotations


class ExternalDraftProposer:
    """Proposes no draft tokens (drafts come from the MineDraft drafter; see module docstring).

    Args:
        vllm_config: vLLM's config (required by the ``custom_class`` contract; unused).
    """

    def __init__(self, vllm_config) -> None:
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens

    def load_model(self, *args, **kwargs) -> None:
        """No weights to load (vLLM's CPU model runner calls this on every drafter)."""

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        """``[]`` for each of the ``len(sampled_token_ids)`` requests of the step."""
        return [[] for _ in sampled_token_ids]
