"""The attention function that reads and writes the slot KV cache (``specdec.kv.kv_cache``).

``slot_attention_forward`` is registered with transformers' ``AttentionInterface`` under
``SLOT_ATTENTION_NAME``. The model's ``forward`` receives a ``SlotAttentionMetadata`` (or, on the
static-shape path, a ``StaticSlotMetadata``) as the keyword argument ``slot_metadata``;
transformers passes it on to every attention layer, where the new keys/values are written at
their positions and the queries attend over each row's cache prefix.

Grouped-query attention never repeats K/V: the ``G = H / KVH`` query heads of each KV head are
folded into the query axis (row ``g * q + t`` is head g's token t), so the cache prefix is read
once instead of copied G times per layer.

On CUDA the dynamic-shape paths (prefill, uncaptured steps) leave out cuDNN's SDPA backend: it
builds an execution plan for every new (batch, length) shape, and every prompt has a new length.
On an H200 that was 60-140 ms of host time per attention call of a new shape (a drafter prefill
of a 300-token prompt: 704 of 723 ms in ``_cudnn_attention_forward``), against 5-26 ms for the
whole prefill once planned. The static (CUDA graph) path keeps the default choice: its shapes are
a fixed set captured at start-up.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.kv.kv_metadata import (
    CAUSAL_MASK, SLOT_ATTENTION_NAME, SLOT_METADATA_KWARG, STATIC_K_BUFFER, STATIC_V_BUFFER, SlotAttentionMetadata,
    StaticSlotMetadata,
)

# SDPA backends of the dynamic-shape paths on CUDA: all but cuDNN (module docstring)
DYNAMIC_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _dynamic_backends(query: torch.Tensor):
    """Context of a dynamic-shape attention call: no cuDNN SDPA on CUDA, no change on CPU."""
    return sdpa_kernel(DYNAMIC_SDPA_BACKENDS) if query.is_cuda else contextlib.nullcontext()


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
    with _dynamic_backends(query):
        if meta.is_rowwise:
            k_cache, v_cache = meta.cache.k[module.layer_idx], meta.cache.v[module.layer_idx]
            return _rowwise_attention(query, k_cache, v_cache, meta, scaling), None
        if isinstance(meta.attn_mask, str) and meta.attn_mask == CAUSAL_MASK:  # whole prompts, empty slots
            return _causal_prefill_attention(query, key, value, meta.cache.dtype, scaling), None
        k_all, v_all = meta.cache.read(module.layer_idx, meta)
        return _grouped_attention(query, k_all, v_all, meta.attn_mask, scaling), None


def _causal_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache_dtype: torch.dtype, scaling: float | None,
) -> torch.Tensor:
    """Batched layout, every row a whole prompt in an empty slot (``CAUSAL_MASK``): causal SDPA
    over the new keys/values themselves (as stored: rounded to the cache dtype), grouped-query
    heads by ``enable_gqa``; the same result as reading them back from the cache under the
    causal mask, without the mask, its repeat and the cache read.

    Shapes: query ``[b, H, q, d]``, key/value ``[b, KVH, q, d]``; returns ``[b, q, H, d]``.
    """
    k_all = key.to(cache_dtype).to(query.dtype)
    v_all = value.to(cache_dtype).to(query.dtype)
    out = F.scaled_dot_product_attention(query, k_all, v_all, dropout_p=0.0, is_causal=True, scale=scaling,
                                         enable_gqa=True)                                # [b, H, q, d]
    return out.transpose(1, 2).contiguous()


def _grouped_attention(
    query: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, attn_mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Batched grouped-query SDPA without repeating K/V (module docstring).

    Shapes: query ``[b, H, q, d]``; k_all/v_all ``[b, KVH, kv_len, d]``; attn_mask
    ``[b, 1, G * q, kv_len]`` bool, already folded (``SlotKVCache._batch_mask``); returns
    ``[b, q, H, d]``.
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads = k_all.shape[1]
    num_groups = num_heads // num_kv_heads
    if attn_mask.shape[2] != num_groups * q_len:
        raise ValueError(f"attn_mask must be folded to [b, 1, {num_groups * q_len}, kv_len], got {tuple(attn_mask.shape)}")
    folded = query.reshape(batch, num_kv_heads, num_groups * q_len, head_dim)
    out = F.scaled_dot_product_attention(
        folded, k_all.to(query.dtype), v_all.to(query.dtype), attn_mask=attn_mask, dropout_p=0.0,
        scale=scaling,
    )                                                                    # [b, KVH, G*q, d]
    return out.reshape(batch, num_heads, q_len, head_dim).transpose(1, 2).contiguous()


def _rowwise_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: SlotAttentionMetadata,
    scaling: float | None,
) -> torch.Tensor:
    """Row-wise grouped-query SDPA: row i attends over the view ``cache[slot_i, :, :len_i]``
    (no gather copy, no padded keys read; ``SlotAttentionMetadata``).

    Shapes: query ``[b, H, q, d]``; k_cache/v_cache one layer's ``[slots, KVH, max_model_len, d]``;
    returns ``[b, q, H, d]``. One SDPA call per row (``b`` per layer).
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    folded = query.reshape(batch, num_kv_heads, (num_heads // num_kv_heads) * q_len, head_dim)
    out = torch.empty_like(folded)                                       # [b, KVH, G*q, d]
    for row, (slot, length, mask) in enumerate(zip(meta.row_slots, meta.row_lens, meta.row_masks)):
        k_row = k_cache[slot : slot + 1, :, :length].to(query.dtype)     # [1, KVH, len, d] view
        v_row = v_cache[slot : slot + 1, :, :length].to(query.dtype)
        if isinstance(mask, str) and mask == CAUSAL_MASK:               # prefill of an empty slot
            row_out = F.scaled_dot_product_attention(
                query[row : row + 1], k_row, v_row, dropout_p=0.0, is_causal=True, scale=scaling,
                enable_gqa=True)                                         # [1, H, q, d]
            out[row : row + 1] = row_out.reshape(1, num_kv_heads, -1, head_dim)
            continue
        out[row : row + 1] = F.scaled_dot_product_attention(
            folded[row : row + 1], k_row, v_row, attn_mask=mask, dropout_p=0.0, scale=scaling)
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
