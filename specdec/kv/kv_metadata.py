"""Names and per-forward metadata of the slot KV cache (``specdec.kv.kv_cache``) and its attention
(``specdec.kv.slot_attention``); a leaf module so both can import it without a cycle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SLOT_ATTENTION_NAME = "minedraft_slot"
SLOT_METADATA_KWARG = "slot_metadata"
NOT_CONSECUTIVE = -1  # SlotAttentionMetadata.first_slot when the batch's slots need a gather
# Names of the non-persistent buffers through which the static path gives each attention module
# its own layer's cache tensors (``specdec.engine.static_forward.attach_cache_buffers``): no Python layer
# index inside a compiled decoder layer, so one compiled graph serves every layer.
STATIC_K_BUFFER = "minedraft_k_cache"
STATIC_V_BUFFER = "minedraft_v_cache"
# SlotAttentionMetadata.row_masks entry of a row whose queries are exactly its keys (a prefill
# into an empty slot): causal SDPA without a mask (half the work of a masked one on CPU)
CAUSAL_MASK = "causal"


@dataclass(frozen=True)
class SlotAttentionMetadata:
    """Per-forward description of where a ragged batch lives in the slot cache.

    Built once per forward by ``SlotKVCache.prepare`` and shared by all layers. Two attention
    layouts (``specdec.kv.slot_attention``):

    - *row-wise* (``row_masks`` set; the CPU default): each row attends over a view of its own
      slot's first ``row_lens[i]`` cache positions, so no row reads another row's padding and no
      gather copies the cache (issue 8 CPU profile: with ragged contexts and non-consecutive
      slots the batched layout spent ~25% of a decode step copying and reading padding);
    - *batched* (``row_masks`` None): the rows' caches are read as one ``[b, KVH, kv_len, d]``
      tensor (a view when ``first_slot`` is set, else a gather) under ``attn_mask``.

    Attributes:
        cache: the cache to read and write.
        slot_ids: ``[b]`` int64, slot of each batch row.
        positions: ``[b, q]`` int64, absolute position of each token (padding continues the
            row's positions; it is never written and never attended by real tokens).
        write_rows, write_cols: ``[n]`` int64, slot and position of each real (non-padding)
            token, in row-major order of the batch.
        is_real: ``[b, q]`` bool, True for real tokens; None when every token is real.
        attn_mask: batched layout: ``[b, 1, G * q, kv_len]`` bool, True where a query may attend
            a cached key, the ``G`` query heads of a KV head folded into the query axis (row
            ``g * q + t`` is token t), or ``CAUSAL_MASK`` when every row is a whole prompt in an
            empty slot without padding; None in the row-wise layout.
        kv_len: number of cache positions read (max over rows of the new sequence length).
        first_slot: ``slot_ids[0]`` when the slots are consecutive ascending ids (then the
            cache is read as a view, no gather), else ``NOT_CONSECUTIVE``.
        row_slots: the ``b`` slot ids as Python ints.
        row_lens: the ``b`` new sequence lengths (cached + new real tokens) as Python ints.
        row_masks: row-wise layout: per row ``[1, 1, G * q, row_lens[i]]`` bool with the
            ``G = num_query_groups`` query heads of a KV head folded into the query axis, None
            for a row whose queries may attend all of its keys (q = 1), or ``CAUSAL_MASK`` for
            a prefill into an empty slot; None: batched.
    """

    cache: "SlotKVCache"  # noqa: F821  (specdec.kv.kv_cache)
    slot_ids: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    write_cols: torch.Tensor
    is_real: torch.Tensor | None
    attn_mask: torch.Tensor | str | None
    kv_len: int
    first_slot: int
    row_slots: tuple[int, ...] = ()
    row_lens: tuple[int, ...] = ()
    row_masks: tuple[torch.Tensor | str | None, ...] | None = None

    @property
    def is_rowwise(self) -> bool:
        """True for the row-wise attention layout."""
        return self.row_masks is not None


@dataclass(frozen=True)
class StaticSlotMetadata:
    """Slot-cache metadata of the static-shape path (``specdec.engine.cuda_graphs``): device tensors
    only, fixed shapes per (batch bucket ``B``, tokens per row ``q``, KV bucket ``kv_len``), so
    a step can be captured in a CUDA graph and replayed.

    Attributes:
        cache: the cache (with its scratch slot ``cache.scratch_slot``).
        slot_ids: ``[B]`` int64, slot of each row (the scratch slot for batch-padding rows).
        write_rows, write_cols: ``[B * q]`` int64, where each token's key/value goes; padding
            tokens go to the scratch slot, so every index write has the same shape.
        attn_mask: ``[B, 1, num_groups * q, kv_len]`` bool, True where a query may attend; the
            query heads of one KV head are folded into the query axis (grouped-query attention
            without repeating K/V), row ``g * q + t`` is token t's mask.
        kv_len: number of cache positions read (the KV bucket).
    """

    cache: "SlotKVCache"  # noqa: F821  (specdec.kv.kv_cache)
    slot_ids: torch.Tensor
    write_rows: torch.Tensor
    write_cols: torch.Tensor
    attn_mask: torch.Tensor
    kv_len: int
