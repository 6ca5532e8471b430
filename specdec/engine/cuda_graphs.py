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

One-prompt prefills (an admission of one request, the common case in service) are launch-bound
too: ~1200 kernel launches for a few ms of GPU work (bench/results/HISTORY.md, "GPU admission of one
prompt"). ``StaticStepper.prefill`` pads such a prompt to a **length bucket** (powers of two
from 16 up to ``ModelConfig.max_graph_prefill_tokens``), captures one graph per bucket that
computes only the last real token's logits, and replays it; the padding tokens go to the
scratch slot, and causal attention keeps them out of the real tokens' results.

``ModelConfig.compile_layers`` additionally runs static steps through ``torch.compile``'d
decoder layers (``compile_layers``), which fuses each layer's elementwise kernels. Measured on an
H200 (bench/results/HISTORY.md, "GPU: engine step"; random weights, bf16): SmolLM2-135M shape decode at
batch 1 26.2 ms eager -> 3.3 ms graphs -> 1.7 ms graphs + compiled layers; Llama-3-8B shape
31.2 -> 7.5 -> 5.6 ms (floor 3.4 ms).
"""

from __future__ import annotations

import logging
import time

import torch

from specdec.engine.compile import compile_layers
from specdec.kv.kv_cache import SlotKVCache
from specdec.engine.shape_buckets import (  # noqa: F401  (MIN_KV_BUCKET, kv_buckets: re-exported)
    MIN_KV_BUCKET, batch_buckets, kv_buckets, prefill_buckets, smallest_at_least,
)
from specdec.engine.static_forward import attach_cache_buffers, static_forward

logger = logging.getLogger(__name__)

NUM_WARMUP_RUNS = 2        # eager runs on a side stream before a capture (cuBLAS workspaces)


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
        max_prefill_tokens: longest prompt whose one-prompt prefill takes the static path
            (``prefill``; the resolved ``ModelConfig.max_graph_prefill_tokens``); 0: none.
    """

    def __init__(self, model, cache: SlotKVCache, max_num_seqs: int, max_model_len: int,
                 max_tokens: int, use_graphs: bool, compile_layers: bool = False,
                 max_prefill_tokens: int = 0) -> None:
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
        self.prefill_buckets = prefill_buckets(min(max_prefill_tokens, max_model_len), max_tokens)
        self._graphs: dict[tuple, tuple] = {}   # (B, q, kv_len, is_last_only) -> (graph, in, out)
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.capture_error: str | None = None   # set when a capture failed (graphs then off)
        self.used_shapes: set[tuple[int, int, int]] = set()   # (B, q, kv_len) of every step
        self.precaptured_shapes: set[tuple[int, int, int]] = set()
        self.used_prefill_shapes: set[tuple[int, int]] = set()   # (q bucket, kv_len)
        self.precaptured_prefill_shapes: set[tuple[int, int]] = set()

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far (one per (batch bucket, tokens per row, KV bucket), and one
        per prefill (length bucket, KV bucket))."""
        return len(self._graphs)

    def accepts(self, num_rows: int, num_tokens: int) -> bool:
        """True when a step of ``num_rows`` rows of at most ``num_tokens`` tokens fits."""
        return num_rows <= self.batch_buckets[-1] and num_tokens <= self.max_tokens

    def accepts_prefill(self, num_rows: int, num_tokens: int) -> bool:
        """True for one prompt longer than a step's rows and within the prefill buckets."""
        return (num_rows == 1 and bool(self.prefill_buckets)
                and self.max_tokens < num_tokens <= self.prefill_buckets[-1])

    def prefill(self, slot: int, token_ids: list[int], start: int, pad_token_id: int) -> torch.Tensor:
        """Last-token logits ``[1, V]`` (model dtype, a fresh tensor) of one prompt, padded to
        its length bucket; the padding tokens' keys and values go to the scratch slot.

        ``start`` is the slot's cached length; the caller checked ``accepts_prefill`` and the
        batch, and commits the new length afterwards.
        """
        num_tokens = smallest_at_least(self.prefill_buckets, len(token_ids))
        kv_len = smallest_at_least(self.kv_buckets, max(num_tokens, start + len(token_ids)))
        self.used_prefill_shapes.add((num_tokens, kv_len))
        packed = self._pack([slot], [token_ids], [start], 1, num_tokens, pad_token_id)
        return self._run((1, num_tokens, kv_len, True), packed, 1)

    def forward(self, slots: list[int], token_ids: list[list[int]], starts: list[int],
                pad_token_id: int) -> torch.Tensor:
        """Logits ``[b, q_max, V]`` (model dtype, a fresh tensor) of one step.

        ``starts[i]`` is slot ``slots[i]``'s cached length; the caller validated the batch and
        commits the new lengths afterwards.
        """
        num_rows, num_tokens = len(slots), max(len(row) for row in token_ids)
        batch = smallest_at_least(self.batch_buckets, num_rows)
        kv_len = smallest_at_least(
            self.kv_buckets, max(s + len(row) for s, row in zip(starts, token_ids)))
        self.used_shapes.add((batch, num_tokens, kv_len))
        packed = self._pack(slots, token_ids, starts, batch, num_tokens, pad_token_id)
        return self._run((batch, num_tokens, kv_len, False), packed, num_rows)

    def _run(self, key: tuple, packed: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The first ``num_rows`` rows of the static forward of shape ``key`` on ``packed``:
        a graph replay, or eager (the CPU twin, or after a failed capture)."""
        batch, num_tokens, kv_len, is_last_only = key
        with torch.inference_mode():
            if self.use_graphs:
                try:
                    graph, static_in, static_out = self._graph(key)
                except RuntimeError as exc:
                    self._disable_graphs(exc)
                else:
                    static_in.copy_(packed, non_blocking=True)
                    graph.replay()
                    return static_out[:num_rows].clone()
            logits = static_forward(self.model, self.cache, packed.to(self.cache.device),
                                    num_tokens, kv_len, self._layers, is_last_only)
            return logits[:num_rows].clone()

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch bucket, tokens per row 1..max_tokens, KV bucket) a step can use."""
        return [(b, q, kv) for b in self.batch_buckets for q in range(1, self.max_tokens + 1)
                for kv in self.kv_buckets if kv >= q]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(length bucket, KV bucket) of every one-prompt prefill into an empty slot."""
        return [(q, smallest_at_least(self.kv_buckets, q)) for q in self.prefill_buckets]

    def precapture(self, run_eager: bool = False) -> tuple[int, float]:
        """Capture every shape of ``all_shapes`` and ``prefill_shapes`` now (warm-up), so no
        step or one-prompt admission pays a capture.

        With graphs on each shape is captured (as on first use, writes go to the scratch slot
        only). The CPU twin records the shapes and, with ``run_eager``, runs the static
        forward of each once (same writes, no graph). Returns (number of shapes, seconds).
        """
        started = time.perf_counter()
        keys = [(b, q, kv, False) for b, q, kv in self.all_shapes()]
        keys += [(1, q, kv, True) for q, kv in self.prefill_shapes()]
        with torch.inference_mode():
            for key in keys:
                if self.use_graphs:
                    try:
                        self._graph(key)
                    except RuntimeError as exc:
                        self._disable_graphs(exc)
                        break
                elif run_eager:
                    static_forward(self.model, self.cache, self._dummy_input(key), *key[1:3],
                                   self._layers, key[3])
                batch, num_tokens, kv_len, is_prefill = key
                if is_prefill:
                    self.precaptured_prefill_shapes.add((num_tokens, kv_len))
                else:
                    self.precaptured_shapes.add((batch, num_tokens, kv_len))
        seconds = time.perf_counter() - started
        count = len(self.precaptured_shapes) + len(self.precaptured_prefill_shapes)
        logger.info("precaptured %d static shapes (graphs=%s) in %.1f s", count, self.use_graphs,
                    seconds)
        return count, seconds

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

    def _dummy_input(self, key: tuple) -> torch.Tensor:
        batch, num_tokens = key[:2]
        return torch.tensor([self._padding_row(num_tokens, 0)] * batch,
                            dtype=torch.int64).to(self.cache.device)

    def _graph(self, key: tuple) -> tuple:
        if key not in self._graphs:
            self._graphs[key] = self._capture(key)
        return self._graphs[key]

    def _capture(self, key: tuple) -> tuple:
        """Warm up on a side stream, then capture; every row writes to the scratch slot only.
        ``key``: (batch bucket, tokens per row, KV bucket, is_last_only)."""
        _, num_tokens, kv_len, is_last_only = key
        static_in = self._dummy_input(key)
        side = torch.cuda.Stream(device=self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_RUNS):
                static_forward(self.model, self.cache, static_in, num_tokens, kv_len, self._layers,
                               is_last_only)
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static_out = static_forward(self.model, self.cache, static_in, num_tokens, kv_len,
                                        self._layers, is_last_only)
        logger.debug("captured CUDA graph %s (batch, tokens, kv_len, is_last_only)", key)
        return graph, static_in, static_out
