"""Request-id checks both vLLM workers share (the same errors as the native workers')."""

from __future__ import annotations

from specdec.errors import CapacityError


def check_new_ids(known: dict, ids: list[str], max_num_seqs: int) -> None:
    """Raise ValueError unless ``ids`` are distinct and not in ``known``; CapacityError when they
    do not fit beside ``known`` in ``max_num_seqs`` slots."""
    if len(set(ids)) != len(ids) or any(rid in known for rid in ids):
        raise ValueError(f"request ids must be new and distinct, got {ids}")
    if len(known) + len(ids) > max_num_seqs:
        raise CapacityError(f"no free slot: {len(known)} of {max_num_seqs} in use, {len(ids)} more asked")


def check_token_ids(request_id: str, token_ids: list[int], vocab_size: int) -> None:
    """Raise ValueError naming the request unless every id lies in [0, ``vocab_size``)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids of {request_id!r} must lie in [0, {vocab_size}), got {bad[:8]}")


def known_states(known: dict, request_ids: list[str]) -> list:
    """The states of ``request_ids`` in order. Raises KeyError naming unknown ids, ValueError on repeats."""
    missing = [rid for rid in request_ids if rid not in known]
    if missing:
        raise KeyError(f"unknown request ids: {missing}")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError(f"request_ids must be distinct, got {request_ids}")
    return [known[rid] for rid in request_ids]
