"""The slot KV cache (``SlotKVCache``), its per-step metadata and the slot attention that reads it.
"""
