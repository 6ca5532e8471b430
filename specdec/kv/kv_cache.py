"""Preallocated slot KV cache.

Every sequence owns one *slot*: a fixed row of per-layer key/value tensors of shape
``[max_num_seqs, num_kv_heads, max_model_len, head_dim]`` allocated once at start-up.
``seq_lens[slot]`` counts the valid tokens in that row, so a KV rollback after rejected draft
tokens is only a length change (MineDraft DESIGN.md, "KV cache"; same idea as vLLM's block
tables with one block per sequence).

The attention function that reads and writes it is ``specdec.kv.slot_attention`` (registered with
transformers' ``AttentionInterface`` under ``SLOT_ATTENTION_NAME`` when this module is imported);
the per-forward metadata classes live in ``specdec.kv.kv_metadata``. Both are re-exported here.
"""

from __future__ import annotations

import torch

from specdec.kv.kv_metadata import (  # noqa: F401  (re-exported: the cache's public names)
    CAUSAL_MASK, NOT_CONSECUTIVE, SLOT_ATTENTION_NAME, SLOT_METADATA_KWARG, STATIC_K_BUFFER, STATIC_V_BUFFER,
    SlotAttentionMetadata, StaticSlotMetadata,
)
from specdec.kv.slot_attention import (  # noqa: F401  (re-exported; importing registers the attention)
    _grouped_attention, _rowwise_attention, _static_attention, slot_attention_forward,
)


class SlotKVCache:
    """Per-layer key/value tensors indexed by slot, preallocated at start-up.

    Shapes: ``k[layer]`` and ``v[layer]`` are ``[max_num_seqs + num_scratch_slots,
    num_kv_heads, max_model_len, head_dim]``; ``seq_lens`` is ``[max_num_seqs]`` int64 on the
    CPU (host-side bookkeeping). ``num_scratch_slots`` is 1 for the static-shape path (it writes
    the padding tokens there: ``scratch_slot``), else 0. ``num_query_groups`` (``G``): query
    heads per KV head, for the row-wise attention masks. ``is_rowwise``: attention layout of the
    dynamic path (``SlotAttentionMetadata``); None: row-wise on CPU, batched elsewhere (one SDPA
    call per row and layer is cheap on CPU, but a GPU step would pay a kernel launch each).
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
        num_query_groups: int = 1,
        is_rowwise: bool | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_query_groups", num_query_groups),
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
        self.num_query_groups = num_query_groups
        self.is_rowwise = self.device.type == "cpu" if is_rowwise is None else is_rowwise
        self.is_causal_shortcut = True  # batched layout: whole prompts in empty slots skip the mask (_batch_mask)
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
        starts = [int(self.seq_lens[slot]) for slot in slot_ids]
        new_lens = [start + count for start, count in zip(starts, num_new_tokens)]
        counts = torch.tensor(num_new_tokens, dtype=torch.int64)             # [b]
        offsets = torch.arange(q_len, dtype=torch.int64)                     # [q]
        positions = torch.tensor(starts, dtype=torch.int64)[:, None] + offsets[None, :]  # [b, q]
        slots = torch.tensor(slot_ids, dtype=torch.int64)
        kv_len = max(new_lens)
        if all(count == q_len for count in num_new_tokens):                 # no padding
            is_real = None
            write_rows = slots.repeat_interleave(q_len)
            write_cols = positions.reshape(-1)
        else:
            is_real = offsets[None, :] < counts[:, None]                     # [b, q]
            write_rows = slots[:, None].expand(-1, q_len)[is_real]
            write_cols = positions[is_real]
        attn_mask, row_masks = None, None
        positions_on_device = positions.to(self.device)
        if self.is_rowwise:
            row_masks = tuple(self._row_mask(start, length, q_len) for start, length in zip(starts, new_lens))
        else:
            attn_mask = self._batch_mask(positions_on_device, starts, new_lens, is_real is None, kv_len)
        to_device = self.device
        return SlotAttentionMetadata(
            cache=self,
            slot_ids=slots.to(to_device),
            positions=positions_on_device,
            write_rows=write_rows.to(to_device),
            write_cols=write_cols.to(to_device),
            is_real=None if is_real is None else is_real.to(to_device),
            attn_mask=attn_mask,
            kv_len=kv_len,
            first_slot=_first_if_consecutive(slot_ids),
            row_slots=tuple(slot_ids),
            row_lens=tuple(new_lens),
            row_masks=row_masks,
        )

    def _batch_mask(self, positions: torch.Tensor, starts: list[int], new_lens: list[int], is_unpadded: bool,
                    kv_len: int) -> torch.Tensor | str:
        """Batched layout: ``CAUSAL_MASK`` when every row is a whole prompt prefilled into an empty
        slot without padding (then attention is plain causal over the new keys: no mask, no cache
        read); else ``[b, 1, G * q, kv_len]`` bool (query t may attend keys ``<= positions[t]``
        of its own row), built on the cache's device once per forward with the ``G`` query heads
        of a KV head folded into the query axis (row ``g * q + t`` is token t), not per layer.
        On an H200 a one-prompt admission spent 6-7 ms building this mask on the host and 3-4 ms
        repeating it in each of the 30 layers, of ~40 ms (``bench/cpu/prefill.py --profile``)."""
        q_len = positions.shape[1]
        if self.is_causal_shortcut and q_len > 1 and is_unpadded and not any(starts):
            return CAUSAL_MASK
        key_pos = torch.arange(kv_len, dtype=torch.int64, device=self.device)                    # [kv]
        lens = torch.tensor(new_lens, dtype=torch.int64).to(self.device)                         # [b]
        mask = ((key_pos[None, None, :] <= positions[:, :, None])
                & (key_pos[None, None, :] < lens[:, None, None]))                                # [b, q, kv]
        return mask[:, None].repeat(1, 1, self.num_query_groups, 1)                              # [b, 1, G*q, kv]

    def _row_mask(self, start: int, length: int, q_len: int) -> torch.Tensor | str | None:
        """Row-wise layout: ``[1, 1, G * q_len, length]`` bool, query t (position ``start + t``)
        may attend keys ``<= start + t``, repeated for the G folded query heads; None when
        ``q_len`` is 1 (the one query attends every cached key); ``CAUSAL_MASK`` when the row
        is a whole prefill into an empty slot (``start == 0``, ``length == q_len``)."""
        if q_len == 1:
            return None
        if start == 0 and length == q_len:
            return CAUSAL_MASK
        key_pos = torch.arange(length, dtype=torch.int64)
        query_pos = start + torch.arange(q_len, dtype=torch.int64)
        mask = key_pos[None, :] <= query_pos[:, None]                        # [q, len]
        return mask.repeat(self.num_query_groups, 1)[None, None].to(self.device)

    def write(
        self, layer_idx: int, meta: SlotAttentionMetadata, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store the real tokens' ``key``/``value`` ``[b, num_kv_heads, q, head_dim]``."""
        if meta.is_real is None:                                            # every token is real
            k_new = key.transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)  # [n, kvh, d]
            v_new = value.transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)
        else:
            k_new = key.transpose(1, 2)[meta.is_real]                       # [n, kvh, d]
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
