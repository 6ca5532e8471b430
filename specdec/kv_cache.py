"""Preallocated slot KV cache and the attention function that reads and writes it.

Every sequence owns one *slot*: a fixed row of per-layer key/value tensors of shape
``[max_num_seqs, num_kv_heads, max_model_len, head_dim]`` allocated once at start-up.
``seq_lens[slot]`` counts the valid tokens in that row, so a KV rollback after rejected draft
tokens is only a length change (MineDraft DESIGN.md, "KV cache"; same idea as vLLM's block
tables with one block per sequence).

The attention function ``slot_attention_forward`` is registered with transformers'
``AttentionInterface`` under ``SLOT_ATTENTION_NAME``. The model's ``forward`` receives a
``SlotAttentionMetadata`` as the keyword argument ``slot_metadata``; transformers passes it on
to every attention layer, where the new keys/values are written at their positions and the
queries attend over each row's cache prefix with a causal boolean mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SLOT_ATTENTION_NAME = "minedraft_slot"
SLOT_METADATA_KWARG = "slot_metadata"
NOT_CONSECUTIVE = -1  # SlotAttentionMetadata.first_slot when the batch's slots need a gather
# Names of the non-persistent buffers through which the static path gives each attention module
# its own layer's cache tensors (``specdec.cuda_graphs.attach_cache_buffers``): no Python layer
# index inside a compiled decoder layer, so one compiled graph serves every layer.
STATIC_K_BUFFER = "minedraft_k_cache"
STATIC_V_BUFFER = "minedraft_v_cache"


@dataclass(frozen=True)
class SlotAttentionMetadata:
    """Per-forward description of where a ragged batch lives in the slot cache.

    Built once per forward by ``SlotKVCache.prepare`` and shared by all layers.

    Attributes:
        cache: the cache to read and write.
        slot_ids: ``[b]`` int64, slot of each batch row.
        positions: ``[b, q]`` int64, absolute position of each token (padding continues the
            row's positions; it is never written and never attended by real tokens).
        write_rows, write_cols: ``[n]`` int64, slot and position of each real (non-padding)
            token, in row-major order of the batch.
        is_real: ``[b, q]`` bool, True for real tokens.
        attn_mask: ``[b, 1, q, kv_len]`` bool, True where a query may attend a cached key.
        kv_len: number of cache positions read (max over rows of the new sequence length).
        first_slot: ``slot_ids[0]`` when the slots are consecutive ascending ids (then the
            cache is read as a view, no gather), else ``NOT_CONSECUTIVE``.
    """

    cache: "SlotKVCache"
    slot_ids: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    write_cols: torch.Tensor
    is_real: torch.Tensor
    attn_mask: torch.Tensor
    kv_len: int
    first_slot: int


@dataclass(frozen=True)
class StaticSlotMetadata:
    """Slot-cache metadata of the static-shape path (``specdec.cuda_graphs``): device tensors
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

    cache: "SlotKVCache"
    slot_ids: torch.Tensor
    write_rows: torch.Tensor
    write_cols: torch.Tensor
    attn_mask: torch.Tensor
    kv_len: int


class SlotKVCache:
    """Per-layer key/value tensors indexed by slot, preallocated at start-up.

    Shapes: ``k[layer]`` and ``v[layer]`` are ``[max_num_seqs + num_scratch_slots,
    num_kv_heads, max_model_len, head_dim]``; ``seq_lens`` is ``[max_num_seqs]`` int64 on the
    CPU (host-side bookkeeping). ``num_scratch_slots`` is 1 for the static-shape path (it writes
    the padding tokens there: ``scratch_slot``), else 0.
    Memory: ``2 * num_layers * (max_num_seqs + num_scratch_slots) * num_kv_heads *
    max_model_len * head_dim`` elements of ``dtype`` (see ``num_bytes``).
    """

    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        max_model_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_scratch_slots: int = 0,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_scratch_slots not in (0, 1):
            raise ValueError(f"num_scratch_slots must be 0 or 1, got {num_scratch_slots}")
        self.num_layers = num_layers
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.scratch_slot = max_num_seqs if num_scratch_slots else None
        shape = (max_num_seqs + num_scratch_slots, num_kv_heads, max_model_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int64)

    @property
    def num_bytes(self) -> int:
        """Bytes held by the key and value tensors of all layers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def prepare(
        self, slot_ids: list[int], num_new_tokens: list[int], q_len: int
    ) -> SlotAttentionMetadata:
        """Build the metadata for appending ``num_new_tokens[i]`` tokens to ``slot_ids[i]``.

        Args:
            slot_ids: ``b`` slot ids (distinct; validated by the caller).
            num_new_tokens: ``b`` counts of real tokens per row, each in ``[1, q_len]``.
            q_len: padded number of tokens per row (the forward's ``q``).

        Returns:
            metadata whose ``positions`` ``[b, q_len]`` are also the model's ``position_ids``.
        """
        starts = self.seq_lens[slot_ids]                                     # [b]
        counts = torch.tensor(num_new_tokens, dtype=torch.int64)             # [b]
        offsets = torch.arange(q_len, dtype=torch.int64)                     # [q]
        positions = starts[:, None] + offsets[None, :]                       # [b, q]
        is_real = offsets[None, :] < counts[:, None]                         # [b, q]
        slots = torch.tensor(slot_ids, dtype=torch.int64)
        new_lens = starts + counts                                           # [b]
        kv_len = int(new_lens.max())
        key_pos = torch.arange(kv_len, dtype=torch.int64)                    # [kv]
        attn_mask = (key_pos[None, None, :] <= positions[:, :, None]) & (
            key_pos[None, None, :] < new_lens[:, None, None]
        )                                                                    # [b, q, kv]
        write_rows = slots[:, None].expand(-1, q_len)[is_real]
        write_cols = positions[is_real]
        to_device = self.device
        return SlotAttentionMetadata(
            cache=self,
            slot_ids=slots.to(to_device),
            positions=positions.to(to_device),
            write_rows=write_rows.to(to_device),
            write_cols=write_cols.to(to_device),
            is_real=is_real.to(to_device),
            attn_mask=attn_mask[:, None].to(to_device),
            kv_len=kv_len,
            first_slot=_first_if_consecutive(slot_ids),
        )

    def write(
        self, layer_idx: int, meta: SlotAttentionMetadata, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store the real tokens' ``key``/``value`` ``[b, num_kv_heads, q, head_dim]``."""
        k_new = key.transpose(1, 2)[meta.is_real]                           # [n, kvh, d]
        v_new = value.transpose(1, 2)[meta.is_real]
        self.k[layer_idx][meta.write_rows, :, meta.write_cols] = k_new.to(self.dtype)
        self.v[layer_idx][meta.write_rows, :, meta.write_cols] = v_new.to(self.dtype)

    def read(self, layer_idx: int, meta: SlotAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values of the batch rows, each ``[b, num_kv_heads, kv_len, head_dim]``."""
        k_all = self.k[layer_idx][:, :, : meta.kv_len]
        v_all = self.v[layer_idx][:, :, : meta.kv_len]
        if meta.first_slot == NOT_CONSECUTIVE:
            return k_all.index_select(0, meta.slot_ids), v_all.index_select(0, meta.slot_ids)
        rows = slice(meta.first_slot, meta.first_slot + len(meta.slot_ids))
        return k_all[rows], v_all[rows]

    def commit(self, slot_ids: list[int], num_new_tokens: list[int]) -> None:
        """Advance ``seq_lens`` after a successful forward (padding never counts)."""
        for slot, count in zip(slot_ids, num_new_tokens):
            self.seq_lens[slot] += count

    def truncate(self, slot: int, length: int) -> None:
        """KV rollback: keep the first ``length`` tokens of ``slot`` (O(1), no copy)."""
        if not 0 <= length <= int(self.seq_lens[slot]):
            raise ValueError(
                f"length must be in [0, {int(self.seq_lens[slot])}] for slot {slot}, got {length}"
            )
        self.seq_lens[slot] = length


def _first_if_consecutive(slot_ids: list[int]) -> int:
    """``slot_ids[0]`` if ``slot_ids`` is ``first, first + 1, ...``, else ``NOT_CONSECUTIVE``."""
    first = slot_ids[0]
    is_consecutive = all(slot == first + i for i, slot in enumerate(slot_ids))
    return first if is_consecutive else NOT_CONSECUTIVE


def slot_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention over the slot cache (transformers ``AttentionInterface`` signature).

    Args:
        module: the attention layer; ``module.layer_idx`` selects the cache layer.
        query: ``[b, num_heads, q, head_dim]`` (RoPE applied).
        key, value: ``[b, num_kv_heads, q, head_dim]`` of the new tokens (RoPE applied).
        attention_mask: ignored when ``slot_metadata`` is given (the mask comes from it).
        scaling: softmax scale, default ``head_dim ** -0.5``.
        kwargs: ``slot_metadata`` (``SlotAttentionMetadata``). Without it the call falls back to
            transformers' SDPA attention, so a model switched to this implementation still
            works for plain cache-free forwards.

    Returns:
        ``(attn_output [b, q, num_heads, head_dim], None)``.
    """
    meta = kwargs.pop(SLOT_METADATA_KWARG, None)
    if meta is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if isinstance(meta, StaticSlotMetadata):
        k_cache = getattr(module, STATIC_K_BUFFER, None)
        if k_cache is None:
            k_cache, v_cache = meta.cache.k[module.layer_idx], meta.cache.v[module.layer_idx]
        else:
            v_cache = getattr(module, STATIC_V_BUFFER)
        return _static_attention(k_cache, v_cache, query, key, value, meta, scaling), None
    meta.cache.write(module.layer_idx, meta, key, value)
    k_all, v_all = meta.cache.read(module.layer_idx, meta)
    return _grouped_attention(query, k_all, v_all, meta.attn_mask, scaling), None


def _grouped_attention(
    query: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, attn_mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Grouped-query SDPA without repeating K/V: the ``G = H / KVH`` query heads of each KV
    head are folded into the query axis (row ``g * q + t`` is head g's token t), so the cache
    prefix is read once instead of copied G times per layer (issue 8: the ``repeat_kv`` copies
    were a large share of a CPU decode step's memory traffic).

    Shapes: query ``[b, H, q, d]``; k_all/v_all ``[b, KVH, kv_len, d]``; attn_mask
    ``[b, 1, q, kv_len]`` bool; returns ``[b, q, H, d]``.
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads = k_all.shape[1]
    num_groups = num_heads // num_kv_heads
    if num_groups == 1:
        folded, mask = query, attn_mask
    else:
        folded = query.reshape(batch, num_kv_heads, num_groups * q_len, head_dim)
        mask = attn_mask.repeat(1, 1, num_groups, 1)                   # [b, 1, G*q, kv_len]
    out = F.scaled_dot_product_attention(
        folded, k_all.to(query.dtype), v_all.to(query.dtype), attn_mask=mask, dropout_p=0.0,
        scale=scaling,
    )                                                                    # [b, KVH, G*q, d]
    return out.reshape(batch, num_heads, q_len, head_dim).transpose(1, 2).contiguous()


def _static_attention(
    k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, meta: StaticSlotMetadata, scaling: float | None,
) -> torch.Tensor:
    """Static-shape slot attention: index writes, a slot gather of ``kv_len`` positions, and
    SDPA with the query heads of each KV head folded into the query axis (no K/V repeat).

    Shapes: ``k_cache``/``v_cache`` one layer's ``[slots, KVH, max_model_len, d]``; query
    ``[B, H, q, d]``, key/value ``[B, KVH, q, d]``; returns ``[B, q, H, d]``.
    No host syncs and no data-dependent shapes (CUDA-graph capturable).
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_groups = num_heads // num_kv_heads
    k_new = key.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
    v_new = value.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
    k_cache[meta.write_rows, :, meta.write_cols] = k_new.to(k_cache.dtype)
    v_cache[meta.write_rows, :, meta.write_cols] = v_new.to(v_cache.dtype)
    k_all = k_cache[:, :, : meta.kv_len].index_select(0, meta.slot_ids)
    v_all = v_cache[:, :, : meta.kv_len].index_select(0, meta.slot_ids)
    folded = query.reshape(batch, num_kv_heads, num_groups * q_len, head_dim)
    out = F.scaled_dot_product_attention(
        folded, k_all.to(query.dtype), v_all.to(query.dtype), attn_mask=meta.attn_mask,
        dropout_p=0.0, scale=scaling,
    )                                                                    # [B, KVH, G*q, d]
    return out.reshape(batch, num_heads, q_len, head_dim).transpose(1, 2).contiguous()


AttentionInterface.register(SLOT_ATTENTION_NAME, slot_attention_forward)
