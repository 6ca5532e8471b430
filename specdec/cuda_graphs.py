"""Static-shape model steps, captured as CUDA graphs per shape bucket and replayed.

Decode, draft and verify steps are launch-bound on a GPU: an eager transformers forward issues
hundreds of small kernels, each with ~5-20 us of Python and launch overhead, while the work
itself (reading the weights once) takes far less (issue 9: a 135M model's eager decode step
took ~21 ms on an H200). This module runs such steps with static shapes so that each shape can
be captured once with ``torch.cuda.CUDAGraph`` and replayed with one launch:

- the batch is padded to a **batch bucket** ``B`` (powers of two up to ``max_num_seqs``, and
  ``max_num_seqs`` itself); padding rows use the cache's scratch slot;
- every row holds ``q`` tokens (the step's longest row: 1 for decode/draft, k + 1 for verify);
  a shorter row's padding tokens are written to the scratch slot, never to the row's slot;
- the KV cache is read over a **KV bucket** ``kv_len`` (powers of two from
  ``MIN_KV_BUCKET`` up to ``max_model_len``, and ``max_model_len``) that covers every row;
- positions, the attention mask and the KV write indices are computed on the device from one
  packed ``[B, q + 3]`` int64 input (tokens, slot, cached length, real token count), so a step
  has no host syncs and no data-dependent Python branches inside.

One graph is captured lazily per ``(B, q, kv_len)`` the first time that shape is used (warm-up
runs and the capture write only to the scratch slot); all graphs share one memory pool. On a CPU
(or with ``ModelConfig.cuda_graphs=False, static_shapes=True``) the same static function runs
eagerly: the CPU twin that CI checks against the dynamic path (``tests/test_cuda_graphs.py``).
Padding rows never change real rows' results: attention, norms and matmuls are row-wise.

``ModelConfig.compile_layers`` additionally runs static steps through ``torch.compile``'d
decoder layers (``compile_layers``), which fuses each layer's elementwise kernels. Measured on an
H200 (BENCHMARKS.md, "GPU: engine step"; random weights, bf16): SmolLM2-135M shape decode at
batch 1 26.2 ms eager -> 3.3 ms graphs -> 1.7 ms graphs + compiled layers; Llama-3-8B shape
31.2 -> 7.5 -> 5.6 ms (floor 3.4 ms).
"""

from __future__ import annotations

import logging
import time

import torch

from specdec.compile import compile_layers
from specdec.kv_cache import (
    SLOT_METADATA_KWARG, STATIC_K_BUFFER, STATIC_V_BUFFER, SlotKVCache, StaticSlotMetadata,
)

logger = logging.getLogger(__name__)

MIN_KV_BUCKET = 64
NUM_WARMUP_RUNS = 2        # eager runs on a side stream before a capture (cuBLAS workspaces)
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


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs``: e.g. 12 -> (1, 2, 4, 8, 12)."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if (1 << i) < max_num_seqs]
    return tuple(buckets + [max_num_seqs])


def kv_buckets(max_model_len: int) -> tuple[int, ...]:
    """Powers of two from ``MIN_KV_BUCKET`` below ``max_model_len``, then ``max_model_len``."""
    buckets, size = [], MIN_KV_BUCKET
    while size < max_model_len:
        buckets.append(size)
        size *= 2
    return tuple(buckets + [max_model_len])


def _smallest_at_least(buckets: tuple[int, ...], value: int) -> int:
    return next(b for b in buckets if b >= value)


def static_forward(model, cache: SlotKVCache, packed: torch.Tensor, num_tokens: int,
                   kv_len: int, layers: torch.nn.ModuleList | None = None) -> torch.Tensor:
    """One static-shape forward (capturable: device ops only, shapes fixed by the arguments).

    Args:
        model: causal LM using slot attention.
        cache: slot cache with a scratch slot.
        packed: ``[B, q + 3]`` int64 on the cache's device: columns ``0..q-1`` token ids
            (padding: any valid id), ``q`` slot (scratch slot for padding rows), ``q + 1``
            cached length before the step, ``q + 2`` number of real tokens (1..q).
        num_tokens: ``q``. kv_len: KV bucket, >= every row's cached length + real tokens.
        layers: compiled decoder layers (``compile_layers``) used for this forward, or None.

    Returns:
        logits ``[B, q, V]`` in the model's dtype (rows/tokens past the real ones are junk).
    """
    device = packed.device
    tokens = packed[:, :num_tokens]
    slots, starts, counts = (packed[:, num_tokens + i] for i in range(NUM_META_COLUMNS))
    offsets = torch.arange(num_tokens, device=device)
    positions = starts[:, None] + offsets[None, :]                           # [B, q]
    is_real = offsets[None, :] < counts[:, None]                             # [B, q]
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
    try:
        out = model(input_ids=tokens, position_ids=positions, use_cache=False,
                    **{SLOT_METADATA_KWARG: meta})
    finally:
        decoder.layers = eager_layers
    return out.logits


_compile_layers_of = compile_layers   # StaticStepper.__init__ has an argument of that name


class StaticStepper:
    """Runs steps of at most ``max_tokens`` tokens per row through the static-shape path,
    with CUDA graphs (``use_graphs``) or eagerly (the CPU twin).

    Args:
        model: the runner's model (slot attention). cache: its cache, with a scratch slot.
        max_num_seqs, max_model_len: the cache's capacity (bucket ranges).
        max_tokens: longest row taken (``ModelConfig.max_static_tokens``).
        use_graphs: capture/replay CUDA graphs (CUDA device only).
        compile_layers: run static steps through ``torch.compile``'d decoder layers.
    """

    def __init__(self, model, cache: SlotKVCache, max_num_seqs: int, max_model_len: int,
                 max_tokens: int, use_graphs: bool, compile_layers: bool = False) -> None:
        if cache.scratch_slot is None:
            raise ValueError("the static path needs a cache with a scratch slot")
        if use_graphs and cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, got {cache.device}")
        self.model, self.cache, self.max_tokens = model, cache, max_tokens
        attach_cache_buffers(model, cache)
        self._layers = _compile_layers_of(model) if compile_layers else None
        self.use_graphs = use_graphs
        self.batch_buckets = batch_buckets(max_num_seqs)
        self.kv_buckets = kv_buckets(max_model_len)
        self._graphs: dict[tuple[int, int, int], tuple] = {}   # key -> (graph, input, logits)
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.capture_error: str | None = None   # set when a capture failed (graphs then off)
        self.used_shapes: set[tuple[int, int, int]] = set()   # (B, q, kv_len) of every step
        self.precaptured_shapes: set[tuple[int, int, int]] = set()

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far (one per (batch bucket, tokens per row, KV bucket))."""
        return len(self._graphs)

    def accepts(self, num_rows: int, num_tokens: int) -> bool:
        """True when a step of ``num_rows`` rows of at most ``num_tokens`` tokens fits."""
        return num_rows <= self.batch_buckets[-1] and num_tokens <= self.max_tokens

    def forward(self, slots: list[int], token_ids: list[list[int]], starts: list[int],
                pad_token_id: int) -> torch.Tensor:
        """Logits ``[b, q_max, V]`` (model dtype, a fresh tensor) of one step.

        ``starts[i]`` is slot ``slots[i]``'s cached length; the caller validated the batch and
        commits the new lengths afterwards.
        """
        num_rows, num_tokens = len(slots), max(len(row) for row in token_ids)
        batch = _smallest_at_least(self.batch_buckets, num_rows)
        kv_len = _smallest_at_least(
            self.kv_buckets, max(s + len(row) for s, row in zip(starts, token_ids)))
        self.used_shapes.add((batch, num_tokens, kv_len))
        packed = self._pack(slots, token_ids, starts, batch, num_tokens, pad_token_id)
        with torch.inference_mode():
            if not self.use_graphs:
                logits = static_forward(self.model, self.cache, packed.to(self.cache.device),
                                        num_tokens, kv_len, self._layers)
                return logits[:num_rows].clone()
            try:
                graph, static_in, static_out = self._graph(batch, num_tokens, kv_len)
            except RuntimeError as exc:
                self._disable_graphs(exc)
                return self.forward(slots, token_ids, starts, pad_token_id)
            static_in.copy_(packed, non_blocking=True)
            graph.replay()
            return static_out[:num_rows].clone()

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch bucket, tokens per row 1..max_tokens, KV bucket) a step can use."""
        return [(b, q, kv) for b in self.batch_buckets for q in range(1, self.max_tokens + 1)
                for kv in self.kv_buckets if kv >= q]

    def precapture(self, run_eager: bool = False) -> tuple[int, float]:
        """Capture every shape of ``all_shapes`` now (warm-up), so no step pays a capture.

        With graphs on each shape is captured (as on first use, writes go to the scratch slot
        only). The CPU twin records the shapes and, with ``run_eager``, runs the static
        forward of each once (same writes, no graph). Returns (number of shapes, seconds).
        """
        started = time.perf_counter()
        with torch.inference_mode():
            for batch, num_tokens, kv_len in self.all_shapes():
                if self.use_graphs:
                    try:
                        self._graph(batch, num_tokens, kv_len)
                    except RuntimeError as exc:
                        self._disable_graphs(exc)
                        break
                elif run_eager:
                    dummy = [self._padding_row(num_tokens, 0)] * batch
                    static_forward(self.model, self.cache,
                                   torch.tensor(dummy, dtype=torch.int64).to(self.cache.device),
                                   num_tokens, kv_len, self._layers)
                self.precaptured_shapes.add((batch, num_tokens, kv_len))
        seconds = time.perf_counter() - started
        logger.info("precaptured %d static shapes (graphs=%s) in %.1f s",
                    len(self.precaptured_shapes), self.use_graphs, seconds)
        return len(self.precaptured_shapes), seconds

    def _disable_graphs(self, exc: Exception) -> None:
        """A capture failed: log it, keep the static path but run it eagerly from now on."""
        self.capture_error = f"{type(exc).__name__}: {exc}"
        self.use_graphs = False
        torch.cuda.synchronize(self.cache.device)
        logger.warning("CUDA graph capture failed, running static steps eagerly: %s",
                       self.capture_error)

    def _pack(self, slots, token_ids, starts, batch, num_tokens, pad_token_id) -> torch.Tensor:
        rows = [row + [pad_token_id] * (num_tokens - len(row)) + [slot, start, len(row)]
                for slot, row, start in zip(slots, token_ids, starts)]
        rows += [self._padding_row(num_tokens, pad_token_id)] * (batch - len(rows))
        return torch.tensor(rows, dtype=torch.int64)

    def _padding_row(self, num_tokens: int, pad_token_id: int) -> list[int]:
        """A batch-padding row: the scratch slot, empty, ``num_tokens`` causal tokens."""
        return [pad_token_id] * num_tokens + [self.cache.scratch_slot, 0, num_tokens]

    def _graph(self, batch: int, num_tokens: int, kv_len: int) -> tuple:
        key = (batch, num_tokens, kv_len)
        if key not in self._graphs:
            self._graphs[key] = self._capture(batch, num_tokens, kv_len)
        return self._graphs[key]

    def _capture(self, batch: int, num_tokens: int, kv_len: int) -> tuple:
        """Warm up on a side stream, then capture; every row writes to the scratch slot only."""
        dummy = torch.tensor([self._padding_row(num_tokens, 0)] * batch, dtype=torch.int64)
        static_in = dummy.to(self.cache.device)
        side = torch.cuda.Stream(device=self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_RUNS):
                static_forward(self.model, self.cache, static_in, num_tokens, kv_len, self._layers)
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static_out = static_forward(self.model, self.cache, static_in, num_tokens, kv_len,
                                        self._layers)
        logger.debug("captured CUDA graph batch=%d tokens=%d kv_len=%d", batch, num_tokens, kv_len)
        return graph, static_in, static_out
