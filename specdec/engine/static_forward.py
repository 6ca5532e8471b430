"""The static-shape forward (``static_forward``): one model step whose shapes are fixed by its
arguments and whose positions, mask and KV-write indices are computed on the device from one
packed input, so that ``specdec.engine.cuda_graphs.StaticStepper`` can capture it in a CUDA graph."""

from __future__ import annotations

import functools
import inspect

import torch

from specdec.kv.kv_cache import (
    SLOT_METADATA_KWARG, STATIC_K_BUFFER, STATIC_V_BUFFER, SlotKVCache, StaticSlotMetadata,
)

NUM_META_COLUMNS = 3       # packed input columns after the tokens: slot, cached length, count


def attach_cache_buffers(model, cache: SlotKVCache) -> int:
    """Register each attention module's cache layer as its non-persistent buffers
    ``STATIC_K_BUFFER``/``STATIC_V_BUFFER`` (views of ``cache.k/v[layer_idx]``, no copy).

    Returns:
        number of attention modules given buffers.

    Raises:
        ValueError: the model has no attention modules with a ``layer_idx``.
    """
    modules = [m for m in model.modules()
               if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    if not modules:
        raise ValueError("no attention modules with a layer_idx found in the model")
    for module in modules:
        module.register_buffer(STATIC_K_BUFFER, cache.k[module.layer_idx], persistent=False)
        module.register_buffer(STATIC_V_BUFFER, cache.v[module.layer_idx], persistent=False)
    return len(modules)


def static_forward(model, cache: SlotKVCache, packed: torch.Tensor, num_tokens: int,
                   kv_len: int, layers: torch.nn.ModuleList | None = None,
                   is_last_only: bool = False) -> torch.Tensor:
    """One static-shape forward (capturable: device ops only, shapes fixed by the arguments).

    Args:
        model: causal LM using slot attention.
        cache: slot cache with a scratch slot.
        packed: ``[B, q + 3]`` int64 on the cache's device: columns ``0..q-1`` token ids
            (padding: any valid id), ``q`` slot (scratch slot for padding rows), ``q + 1``
            cached length before the step, ``q + 2`` number of real tokens (1..q).
        num_tokens: ``q``. kv_len: KV bucket, >= every row's cached length + real tokens.
        layers: compiled decoder layers (``compile_layers``) used for this forward, or None.
        is_last_only: compute only each row's last real token's logits (a prefill); the LM
            head then runs on ``B`` positions, not ``B * q``.

    Returns:
        logits ``[B, q, V]`` in the model's dtype (rows/tokens past the real ones are junk), or
        ``[B, V]`` with ``is_last_only``.
    """
    device = packed.device
    tokens = packed[:, :num_tokens]
    slots, starts, counts = (packed[:, num_tokens + i] for i in range(NUM_META_COLUMNS))
    offsets = torch.arange(num_tokens, device=device)
    is_real = offsets[None, :] < counts[:, None]                             # [B, q]
    # padding tokens repeat the row's last real position: a model whose RoPE follows the largest
    # position seen (transformers' "dynamic"/"longrope") must not see the bucket's padding
    positions = starts[:, None] + torch.minimum(offsets[None, :], counts[:, None] - 1)   # [B, q]
    key_pos = torch.arange(kv_len, device=device)
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (
        key_pos[None, None, :] < (starts + counts)[:, None, None])           # [B, q, kv]
    text_cfg = model.config.get_text_config()
    num_groups = text_cfg.num_attention_heads // (
        getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads)
    meta = StaticSlotMetadata(
        cache=cache,
        slot_ids=slots,
        write_rows=torch.where(is_real, slots[:, None], cache.scratch_slot).reshape(-1),
        write_cols=torch.where(is_real, positions, offsets[None, :]).reshape(-1),
        attn_mask=mask[:, None].repeat(1, 1, num_groups, 1),                # [B, 1, G*q, kv]
        kv_len=kv_len,
    )
    decoder = model.get_decoder()
    eager_layers = decoder.layers
    if layers is not None:
        decoder.layers = layers
    keep = {}
    if is_last_only and packed.shape[0] == 1 and has_logits_to_keep(model):
        keep = {"logits_to_keep": counts - 1}         # [1]: the one row's last real token
    try:
        logits = model(input_ids=tokens, position_ids=positions, use_cache=False, **keep,
                       **{SLOT_METADATA_KWARG: meta}).logits                  # [B, q or 1, V]
    finally:
        decoder.layers = eager_layers
    if not is_last_only:
        return logits
    if keep:
        return logits[:, 0]
    return logits[torch.arange(logits.shape[0], device=device), counts - 1]    # [B, V]


def has_logits_to_keep(model) -> bool:
    """True when ``model.forward`` takes transformers' ``logits_to_keep`` argument (looked up
    once per model class: eager static prefills ask on every forward)."""
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters
