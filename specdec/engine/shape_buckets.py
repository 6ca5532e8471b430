"""Shape buckets of the static-shape path (``specdec.engine.cuda_graphs``): each step or one-prompt
prefill is padded up to a bucket so that one CUDA graph per bucket serves every size in it."""

from __future__ import annotations

MIN_KV_BUCKET = 64
MIN_PREFILL_BUCKET = 16


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs``: e.g. 12 -> (1, 2, 4, 8, 12)."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if (1 << i) < max_num_seqs]
    return tuple(buckets + [max_num_seqs])


def _powers_of_two_up_to(smallest: int, largest: int) -> tuple[int, ...]:
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    return tuple(buckets + [largest])


def kv_buckets(max_model_len: int) -> tuple[int, ...]:
    """Powers of two from ``MIN_KV_BUCKET`` below ``max_model_len``, then ``max_model_len``."""
    return _powers_of_two_up_to(MIN_KV_BUCKET, max_model_len)


def prefill_buckets(max_prompt_tokens: int, min_tokens: int) -> tuple[int, ...]:
    """Prompt-length buckets (tokens) of one-prompt static prefills: the powers of two from
    ``MIN_PREFILL_BUCKET`` below ``max_prompt_tokens``, then ``max_prompt_tokens``, keeping only
    those above ``min_tokens`` (shorter forwards take the step path); () when
    ``max_prompt_tokens <= min_tokens``. E.g. (1024, 8) -> (16, 32, ..., 512, 1024)."""
    if max_prompt_tokens <= min_tokens:
        return ()
    return tuple(b for b in _powers_of_two_up_to(MIN_PREFILL_BUCKET, max_prompt_tokens)
                 if b > min_tokens)


def smallest_at_least(buckets: tuple[int, ...], value: int) -> int:
    """The first bucket >= ``value`` (``buckets`` ascending; StopIteration past the last)."""
    return next(b for b in buckets if b >= value)
