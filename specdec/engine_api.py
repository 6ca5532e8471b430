"""The engine seam: what ``verifier_svc`` and ``drafter_svc`` call, whatever runs the models.

Two backends implement it (``--engine``):

- ``native``: ``specdec.engine.worker.TargetWorker`` / ``specdec.engine.draft_worker.DraftWorker`` on our
  slot KV cache, rejection sampler and CUDA graphs over transformers' model definitions (the
  CPU default and the float64 reference of the exactness tests);
- ``vllm``: ``specdec.vllm_backend.target.VllmTargetWorker`` /
  ``specdec.vllm_backend.draft.VllmDraftWorker`` on vLLM's engine (paged KV cache, kernels,
  CUDA graphs, rejection sampler, tensor parallelism).

Both return ``specdec.engine.worker_base.StepOutput`` and raise the same errors: ``KeyError`` for an
unknown request id, ``ValueError`` for bad ids/shapes/params, ``CapacityError`` (and its
``DraftCapacityError``) when a slot or the context window runs out, so the services map them to
the same gRPC codes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

ENGINES = ("native", "vllm")


@dataclass(frozen=True)
class EngineFacts:
    """What an engine reports in ``minedraft.v1.EngineInfo``.

    Attributes:
        vocab_size: logits / probability width (ids the model can emit).
        input_vocab_size: token ids the model accepts (embedding rows; >= vocab_size).
        max_num_seqs, max_model_len: resident requests and tokens per request.
        num_free_slots: requests that can still be added.
        eos_token_ids: the model's EOS ids.
        device, dtype: where and in what precision it runs.
        weight_bytes, kv_cache_bytes: memory of the parameters (0: unknown, e.g. vLLM dummy
            weights) and of the KV cache, in bytes.
        sends_draft_probs: a drafter whose sampled drafts come with [b, k, vocab] draft
            probabilities (native); False for token ids only (vLLM) and for verifiers.
    """

    vocab_size: int
    input_vocab_size: int
    max_num_seqs: int
    max_model_len: int
    num_free_slots: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    weight_bytes: int
    kv_cache_bytes: int
    sends_draft_probs: bool = False

    def with_free_slots(self, num_free_slots: int) -> "EngineFacts":
        return replace(self, num_free_slots=num_free_slots)


def runner_facts(runner) -> EngineFacts:
    """``EngineFacts`` of a native ``specdec.engine.runner.ModelRunner``."""
    return EngineFacts(
        vocab_size=runner.vocab_size, input_vocab_size=runner.input_vocab_size,
        max_num_seqs=runner.cache_cfg.max_num_seqs, max_model_len=runner.cache_cfg.max_model_len,
        num_free_slots=runner.num_free_slots, eos_token_ids=tuple(runner.eos_token_ids),
        device=runner.model_cfg.device, dtype=runner.model_cfg.dtype,
        weight_bytes=runner.weight_bytes, kv_cache_bytes=runner.kv_cache_bytes)


class TargetEngine(Protocol):
    """The verifier's engine (see module docstring)."""

    def facts(self) -> EngineFacts: ...

    def add_requests(self, items: list[tuple[str, list[int], object]]) -> list:
        """Prefill (request id, prompt ids, ``SamplingParams``) items; one ``StepOutput`` (the first
        token) each; all or none."""

    def verify(self, request_ids: list[str], draft_token_ids: list[list[int]], draft_probs) -> list:
        """Verify row i's k_i draft tokens (0: decode); ``StepOutput`` of accepted + 1 tokens each."""

    def decode(self, request_ids: list[str], num_steps: int, on_step=None, max_steps: list[int] | None = None) -> list:
        """``num_steps`` plain decode steps in one call (multi-step decoding); ``StepOutput`` of up
        to ``num_steps`` tokens each: fewer for a row that reaches its cap ``max_steps[i]`` (None:
        no caps), samples one of its stop tokens (``SamplingParams.stop_token_set``; it stops
        after that step) or reaches the context window. ``on_step``: called in the engine thread
        after each step with the ``StepOutput``s of the rows that got tokens in it (their new
        tokens only; ``is_final`` on the last of a row that stops before the call's last step),
        the named rows first, then any that joined the call (vLLM engine; their tokens after the
        first, which their join returned)."""

    def release(self, request_id: str) -> None: ...


class DraftEngine(Protocol):
    """The drafter's engine (see module docstring)."""

    def facts(self) -> EngineFacts: ...

    def add_requests(self, items: list[tuple[str, list[int], object]]) -> None: ...

    def draft(self, request_ids: list[str], committed: list[tuple[int, list[int]]],
              num_draft_tokens) -> tuple[list[list[int]], object]:
        """Catch up on the committed tokens (from position ``start`` on: ``token_ids``) and draft
        k_i tokens per request; (draft ids per row, [b, k, V] draft probs or None)."""

    def release(self, request_id: str) -> None: ...
