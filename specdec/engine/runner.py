"""ModelRunner: a causal LM plus its slot KV cache, driven with ragged batches of new tokens.

The runner is the one place that runs a model forward. Workers (``specdec.engine.worker``) use it for
the target model (prefill, verify steps of k+1 tokens) and for the draft model (catch-up,
single-token draft steps); a decode step is a verify step with k = 0 (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import torch

from specdec.config import CUDA_GRAPH_PREFILL_TOKENS, ONE_PROMPT_PER_PREFILL, CacheConfig, ModelConfig
from specdec.engine.compile import compile_modules
from specdec.engine.cuda_graphs import StaticStepper
from specdec.engine.static_forward import has_logits_to_keep
from specdec.errors import CapacityError
from specdec.kv.kv_cache import SLOT_METADATA_KWARG, SlotKVCache
from specdec.models.loader import load_model, use_slot_attention

PAD_TOKEN_ID = 0  # fills ragged rows; padded tokens are never written to the cache


class ModelRunner:
    """A model in eval mode with a preallocated ``SlotKVCache`` of ``cache_cfg`` capacity.

    Args:
        model_cfg: model source, dtype, device, threads.
        cache_cfg: ``max_num_seqs`` slots of ``max_model_len`` tokens each.
        model: an already built ``PreTrainedModel`` (tests, draft formats); it is moved to the
            configured dtype/device and switched to the slot-cache attention. ``None`` loads
            ``model_cfg.model`` with ``specdec.models.loader.load_model``.

    Attributes:
        vocab_size: size of the logits' last dim ``V``.
        input_vocab_size: number of token ids the model accepts (its embedding rows); larger
            than ``vocab_size`` for a draft with a reduced vocabulary (``specdec.models.draft_format``).
        eos_token_ids: EOS ids from the generation config (or model config), as a tuple.
        weight_bytes / kv_cache_bytes: memory held by parameters / by the KV cache.
        static_stepper: the static-shape / CUDA-graph path (``specdec.engine.cuda_graphs``) for steps of
            at most ``model_cfg.max_static_tokens`` tokens per row, or None when
            ``model_cfg.use_static_shapes`` is off (then the cache has no scratch slot).
    """

    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig, model=None) -> None:
        if model_cfg.num_threads is not None:
            torch.set_num_threads(model_cfg.num_threads)
        self.model_cfg = model_cfg
        self.cache_cfg = cache_cfg
        if model is None:
            model = load_model(model_cfg)
        else:
            model = model.to(device=model_cfg.device, dtype=model_cfg.torch_dtype).eval()
            use_slot_attention(model)
        if model_cfg.compile_modules:
            compile_modules(model, torch.device(model_cfg.device))
        self.model = model
        text_cfg = model.config.get_text_config()
        self.vocab_size: int = int(model.get_output_embeddings().out_features)
        self.input_vocab_size: int = int(model.get_input_embeddings().num_embeddings)
        self.eos_token_ids: tuple[int, ...] = _eos_token_ids(model)
        num_kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
        self.cache = SlotKVCache(
            num_layers=text_cfg.num_hidden_layers,
            max_num_seqs=cache_cfg.max_num_seqs,
            max_model_len=cache_cfg.max_model_len,
            num_kv_heads=num_kv_heads,
            num_query_groups=text_cfg.num_attention_heads // num_kv_heads,
            head_dim=getattr(text_cfg, "head_dim", None)
            or text_cfg.hidden_size // text_cfg.num_attention_heads,
            dtype=model_cfg.torch_dtype,
            device=model_cfg.device,
            num_scratch_slots=1 if model_cfg.use_static_shapes else 0,
        )
        self.static_stepper: StaticStepper | None = None
        if model_cfg.use_static_shapes:
            use_graphs = _use_graphs(model_cfg)
            self.static_stepper = StaticStepper(
                model, self.cache, cache_cfg.max_num_seqs, cache_cfg.max_model_len,
                model_cfg.max_static_tokens, use_graphs=use_graphs,
                compile_layers=model_cfg.compile_layers,
                max_prefill_tokens=_graph_prefill_tokens(model_cfg, use_graphs))
            if self.static_stepper.use_graphs and model_cfg.cuda_graph_precapture:
                self.static_stepper.precapture()
        # batched layout: whole unpadded prompts take causal SDPA (another kernel than the masked
        # path) only when every prompt is prefilled alone, so that a prompt's KV never depends on
        # whether it was admitted alone or with others (greedy outputs equal across loads)
        self.cache.is_causal_shortcut = self.prefill_token_budget == ONE_PROMPT_PER_PREFILL
        self._has_logits_to_keep = has_logits_to_keep(model)
        self._free_slots: list[int] = list(range(cache_cfg.max_num_seqs))
        self._allocated: set[int] = set()

    # ---- capacity -------------------------------------------------------------------------
    @property
    def prefill_token_budget(self) -> int:
        """Padded tokens per prefill forward of several prompts (``prefill_groups``): the
        explicit ``max_prefill_tokens``, else 0 (one prompt per forward) while one-prompt graph
        prefills are on, else ``model_cfg.prefill_token_budget``. With graph prefills every
        prompt then gets the same forward whether it arrived alone or in a burst, so its KV
        does not depend on which requests were admitted with it (greedy outputs in bfloat16
        equal across modes and loads), and a one-prompt graph replay (~5 ms for 300 tokens of
        SmolLM2-135M on an H200) is about what a batched prefill costs per prompt."""
        if self.model_cfg.max_prefill_tokens is not None:
            return self.model_cfg.max_prefill_tokens
        if self.static_stepper is not None and self.static_stepper.prefill_buckets:
            return ONE_PROMPT_PER_PREFILL
        return self.model_cfg.prefill_token_budget

    @property
    def num_free_slots(self) -> int:
        """Slots that ``allocate_slot`` can still hand out."""
        return len(self._free_slots)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model parameters (tied weights counted once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the preallocated KV cache."""
        return self.cache.num_bytes

    def allocate_slot(self) -> int:
        """Take the lowest free slot, with an empty KV (length 0).

        Raises:
            CapacityError: all ``max_num_seqs`` slots are in use.
        """
        if not self._free_slots:
            raise CapacityError(
                f"no free KV-cache slot: all max_num_seqs={self.cache_cfg.max_num_seqs} are in use"
            )
        slot = self._free_slots.pop(0)
        self._allocated.add(slot)
        self.cache.truncate(slot, 0)
        return slot

    def free_slot(self, slot: int) -> None:
        """Return ``slot`` to the free list. Raises ValueError if it is not allocated."""
        self._check_slot(slot)
        self.cache.truncate(slot, 0)
        self._allocated.remove(slot)
        self._free_slots.append(slot)
        self._free_slots.sort()

    def seq_len(self, slot: int) -> int:
        """Number of tokens held in the KV cache of ``slot``."""
        self._check_slot(slot)
        return int(self.cache.seq_lens[slot])

    def truncate(self, slot: int, length: int) -> None:
        """KV rollback: keep the first ``length`` tokens (0 <= length <= seq_len(slot))."""
        self._check_slot(slot)
        self.cache.truncate(slot, length)

    # ---- forward --------------------------------------------------------------------------
    def forward(
        self, slots: list[int], token_ids: list[list[int]], logits_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Append ``token_ids[i]`` to slot ``slots[i]`` and return the logits of every new token.

        Ragged rows are right-padded to ``q_max = max(len(t) for t in token_ids)``; the padding
        is neither written to the slots' KV cache nor counted in ``seq_len``. Steps with
        ``q_max <= model_cfg.max_static_tokens`` take the static-shape path (CUDA graphs on a
        GPU) when ``static_stepper`` is set; the results are the same up to rounding.

        Args:
            slots: ``b`` distinct allocated slots.
            token_ids: ``b`` non-empty lists of token ids in ``[0, input_vocab_size)``.
            logits_dtype: dtype of the returned logits (float32 by contract; tests of a
                float64 model pass ``torch.float64`` to see its full precision).

        Returns:
            logits ``[b, q_max, vocab_size]`` in ``logits_dtype``; row i's entries past
            ``len(token_ids[i])`` are junk.

        Raises:
            ValueError: bad slot, empty batch/row, duplicate slot, token id out of range.
            CapacityError: a row would exceed ``max_model_len`` tokens.
        """
        self._check_batch(slots, token_ids)
        return self._run(slots, token_ids, logits_dtype, keep_positions=None)

    def prefill(
        self, slots: list[int], prompts: list[list[int]], logits_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Feed whole prompts in one forward; return each prompt's last-token logits ``[b, V]``.

        Same arguments, checks and errors as ``forward``. The LM head runs only on each prompt's
        last position (``logits_to_keep``; the distinct last positions of ragged prompts), not on
        every prompt token: for a 500-token prompt of SmolLM2-135M that is 500x fewer rows of
        its [49152, 576] head (issue 8, CPU profile: most of a prefill's time was that head).
        One prompt of a length the static stepper's prefill buckets take runs as one padded
        static forward instead (``StaticStepper.prefill``: a CUDA graph replay on a GPU).
        """
        self._check_batch(slots, prompts)
        stepper = self.static_stepper
        if stepper is not None and stepper.accepts_prefill(len(slots), len(prompts[0])):
            start = int(self.cache.seq_lens[slots[0]])
            logits = stepper.prefill(slots[0], list(prompts[0]), start, PAD_TOKEN_ID)   # [1, V]
            self.cache.commit(slots, [len(prompts[0])])
            return logits.to(logits_dtype)
        last = [len(p) - 1 for p in prompts]
        kept = sorted(set(last))
        logits = self._run(slots, prompts, logits_dtype, keep_positions=kept)   # [b, n_kept|q, V]
        # all positions came back (static path, no logits_to_keep) unless the widths match; when
        # they match either way, kept == range(q_max) and both readings pick the same column
        columns = last if logits.shape[1] != len(kept) else [kept.index(pos) for pos in last]
        rows = torch.arange(len(prompts), device=logits.device)
        return logits[rows, torch.tensor(columns, device=logits.device)]

    def _run(self, slots: list[int], token_ids: list[list[int]], logits_dtype: torch.dtype,
             keep_positions: list[int] | None) -> torch.Tensor:
        """Forward of a checked batch. ``keep_positions``: padded positions whose logits are
        computed (``[b, len(keep_positions), V]``), or None for all (``[b, q_max, V]``); the
        static path and models without ``logits_to_keep`` always return all positions."""
        num_new = [len(row) for row in token_ids]
        q_max = max(num_new)
        if self.static_stepper is not None and self.static_stepper.accepts(len(slots), q_max):
            starts = [int(self.cache.seq_lens[slot]) for slot in slots]
            logits = self.static_stepper.forward(slots, token_ids, starts, PAD_TOKEN_ID)
            self.cache.commit(slots, num_new)
            return logits.to(logits_dtype)
        padded = [row + [PAD_TOKEN_ID] * (q_max - len(row)) for row in token_ids]
        input_ids = torch.tensor(padded, dtype=torch.int64, device=self.model_cfg.device)
        meta = self.cache.prepare(slots, num_new, q_max)
        keep = {}
        if keep_positions is not None and self._has_logits_to_keep:
            keep = {"logits_to_keep": torch.tensor(keep_positions, dtype=torch.int64,
                                                   device=self.model_cfg.device)}
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, position_ids=meta.positions, use_cache=False,
                             **keep, **{SLOT_METADATA_KWARG: meta})
        self.cache.commit(slots, num_new)
        return out.logits.to(logits_dtype)

    # ---- checks ---------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.cache_cfg.max_num_seqs:
            raise ValueError(f"slot must be an int in [0, {self.cache_cfg.max_num_seqs}), got {slot!r}")
        if slot not in self._allocated:
            raise ValueError(f"slot {slot} is not allocated")

    def _check_batch(self, slots: list[int], token_ids: list[list[int]]) -> None:
        if not slots or len(slots) != len(token_ids):
            raise ValueError(
                f"slots and token_ids must be non-empty and of equal length, got {len(slots)} "
                f"and {len(token_ids)}"
            )
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {slots}")
        for slot, row in zip(slots, token_ids):
            self._check_slot(slot)
            if not row:
                raise ValueError(f"token_ids for slot {slot} is empty")
            if min(row) < 0 or max(row) >= self.input_vocab_size:
                raise ValueError(f"token ids for slot {slot} must be in [0, {self.input_vocab_size})")
            new_len = int(self.cache.seq_lens[slot]) + len(row)
            if new_len > self.cache_cfg.max_model_len:
                raise CapacityError(
                    f"slot {slot} would hold {new_len} tokens > max_model_len="
                    f"{self.cache_cfg.max_model_len}"
                )


def _use_graphs(model_cfg: ModelConfig) -> bool:
    """``use_cuda_graphs``, except that "auto" (None) stays off inside a tensor-parallel group:
    capturing the all-reduces of a sharded model in CUDA graphs is not validated here (pass
    ``cuda_graphs=True`` to force it); the static path then runs eagerly."""
    in_tp_group = (torch.distributed.is_available() and torch.distributed.is_initialized()
                   and torch.distributed.get_world_size() > 1)
    if model_cfg.cuda_graphs is None and in_tp_group:
        return False
    return model_cfg.use_cuda_graphs


def _graph_prefill_tokens(model_cfg: ModelConfig, use_graphs: bool) -> int:
    """``max_graph_prefill_tokens`` resolved: None means ``CUDA_GRAPH_PREFILL_TOKENS`` while this
    runner's graphs are on (``_use_graphs``) and no batched prefill budget was asked for, else 0."""
    if model_cfg.max_graph_prefill_tokens is not None:
        return model_cfg.max_graph_prefill_tokens
    if model_cfg.max_prefill_tokens:
        return 0
    return CUDA_GRAPH_PREFILL_TOKENS if use_graphs else 0


def _eos_token_ids(model) -> tuple[int, ...]:
    """EOS ids from ``model.generation_config``, falling back to ``model.config``."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
