"""MineDraft draft directory: a small draft model that borrows the target's embeddings and LM head.

A draft directory holds

- ``minedraft_draft.json``: format version, target (alias or path), target fingerprint,
  ``num_layers`` and the target layers that initialised the draft (``init_layers``);
- ``config.json``: the draft's ``LlamaConfig`` (``num_hidden_layers = num_layers``);
- ``model.safetensors``: ONLY the draft's own weights (``model.layers.*`` and ``model.norm``),
  plus, for a reduced draft vocabulary, ``draft_vocab_ids`` (int64 ``[N]``, target token ids).
  Weights over ``MAX_SHARD_BYTES`` are split by whole tensors into ``model-00001-of-0000N.safetensors``
  shards (Hugging Face's shard names), so no file of a committed draft exceeds 16 MiB; read them
  with :func:`read_draft_weights`.

Reduced draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856, Sec. 3): the draft's LM
head covers only the ``N`` target token ids most frequent in the target's own responses; its rows
``[N, hidden]`` are gathered from the borrowed target head at load time (never stored). The draft
model then returns logits ``[..., N]`` over the subset; index ``i`` means target id
``draft_vocab_ids[i]`` (read with :func:`draft_vocab_ids`; the engine maps back to target ids).

At load time the token embeddings ``[vocab, hidden]`` and the LM head ``[vocab, hidden]`` are
taken from the named target and shared by reference (the issue 4 design; EAGLE, Li et al. 2024,
Sec. 4, shares them the same way). A draft is refused with ``IncompatibleDraftError`` when the
target's embeddings do not match the fingerprint recorded at training time.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specdec.config import ModelConfig
from specdec.models.draft_target import (  # noqa: F401  (re-exported: part of the draft-format API)
    EMBED_KEY_SUFFIX, LM_HEAD_KEY, NUM_PROBE_ROWS, PROBE_RTOL, PROBE_SEED, check_fingerprint, embedding_fingerprint,
    read_target_embeddings)
from specdec.models.draft_weights import (  # noqa: F401  (re-exported: part of the draft-format API)
    DRAFT_SHARD_GLOB, DRAFT_WEIGHTS_FILE, MAX_SHARD_BYTES, draft_weight_files, read_draft_weights, write_draft_weights)
from specdec.errors import IncompatibleDraftError
from specdec.models.resolve import resolve_model_dir

DRAFT_META_FILE = "minedraft_draft.json"
FORMAT_VERSION = 1
OWN_WEIGHT_PREFIXES = ("model.layers.", "model.norm.")
DRAFT_VOCAB_KEY = "draft_vocab_ids"
CONFIG_KEYS_NOT_INHERITED = ("quantization_config", "_name_or_path", "_model_name_or_path")  # e.g. GGUF


@dataclass(frozen=True)
class DraftMeta:
    """Contents of ``minedraft_draft.json``.

    Attributes:
        target: target alias (e.g. ``"smollm2-135m-instruct"``) or path of its HF dir.
        target_fingerprint: output of :func:`embedding_fingerprint` for the target.
        num_layers: number of draft decoder layers.
        init_layers: target layer indices that initialised draft layers ``0..num_layers-1``.
        target_gguf_file: GGUF file name when ``target`` is a dir holding a GGUF file.
        training: free-form training summary (loss, tokens, seed, ...).
        format_version: ``FORMAT_VERSION`` of the writer.
        draft_vocab_size: ``N`` of a reduced draft vocabulary, None for the target's full vocab.
    """

    target: str
    target_fingerprint: dict
    num_layers: int
    init_layers: tuple[int, ...]
    target_gguf_file: str | None = None
    training: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be None or >= 1, got {self.draft_vocab_size}")
        if not self.target:
            raise ValueError("target must be a non-empty alias or path")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if len(self.init_layers) != self.num_layers:
            raise ValueError(f"init_layers must have num_layers={self.num_layers} entries")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version} unsupported (want {FORMAT_VERSION})")


def is_draft_dir(path: str) -> bool:
    """True when ``path`` is a directory holding ``minedraft_draft.json``."""
    return os.path.isfile(os.path.join(path, DRAFT_META_FILE))


def read_meta(draft_dir: str) -> DraftMeta:
    """Read ``minedraft_draft.json``. Raises FileNotFoundError, ValueError (bad contents)."""
    with open(os.path.join(draft_dir, DRAFT_META_FILE), encoding="utf-8") as f:
        raw = json.load(f)
    raw["init_layers"] = tuple(raw["init_layers"])
    return DraftMeta(**raw)


def draft_config_from_target(target_config: LlamaConfig, num_layers: int) -> LlamaConfig:
    """Copy of the target's Llama config with ``num_hidden_layers = num_layers``."""
    raw = {k: v for k, v in target_config.to_dict().items() if k not in CONFIG_KEYS_NOT_INHERITED}
    cfg = LlamaConfig.from_dict(raw)
    cfg.num_hidden_layers = num_layers
    cfg.layer_types = None if getattr(cfg, "layer_types", None) is None else ["full_attention"] * num_layers
    return cfg


def build_draft_from_target(target: PreTrainedModel, layers: list[int],
                            vocab_ids: torch.Tensor | None = None) -> LlamaForCausalLM:
    """Draft whose layer i is a copy of ``target`` layer ``layers[i]``; shares embeddings and head.

    ``vocab_ids`` (``[N]`` target ids) gives the draft a reduced head (:func:`set_draft_vocab`).
    Raises ValueError on an empty ``layers`` or an index outside the target's layers.
    """
    num_target = target.config.num_hidden_layers
    if not layers or any(not 0 <= i < num_target for i in layers):
        raise ValueError(f"layers must be non-empty indices in [0, {num_target}), got {layers}")
    draft = LlamaForCausalLM(draft_config_from_target(target.config, len(layers)))
    draft.to(dtype=target.dtype, device=target.device)
    for i, src in enumerate(layers):
        draft.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    attach_target_embeddings(draft, target.model.embed_tokens.weight, target.lm_head.weight)
    if vocab_ids is not None:
        set_draft_vocab(draft, vocab_ids)
    return draft


def set_draft_vocab(draft: LlamaForCausalLM, vocab_ids: torch.Tensor) -> None:
    """Replace the draft's LM head by the rows ``vocab_ids`` of its current (target) head.

    Args:
        draft: a draft whose ``lm_head`` is the full target head ``[V, hidden]``.
        vocab_ids: ``[N]`` distinct target token ids in ``[0, V)`` (any integer dtype).
    Afterwards ``draft(...).logits`` is ``[..., N]`` and ``draft.draft_vocab_ids`` (a
    non-persistent int64 buffer) maps logit index -> target id. The gathered head is frozen.
    Raises ValueError on an empty, non-1-D, duplicated or out-of-range ``vocab_ids``.
    """
    full = draft.lm_head.weight
    ids = vocab_ids.to(device=full.device, dtype=torch.int64)
    if ids.dim() != 1 or ids.numel() == 0 or ids.unique().numel() != ids.numel():
        raise ValueError("vocab_ids must be a non-empty 1-D tensor of distinct token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= full.shape[0]:
        raise ValueError(f"vocab_ids must lie in [0, {full.shape[0]}), got [{int(ids.min())}, {int(ids.max())}]")
    head = torch.nn.Linear(full.shape[1], ids.numel(), bias=False, device=full.device, dtype=full.dtype)
    head.weight = torch.nn.Parameter(full.detach()[ids].clone(), requires_grad=False)
    draft.lm_head = head
    draft.register_buffer(DRAFT_VOCAB_KEY, ids, persistent=False)


def draft_vocab_ids(model: torch.nn.Module) -> torch.Tensor | None:
    """``[N]`` int64 target ids of a reduced-vocabulary draft's logits, None for a full vocab."""
    return getattr(model, DRAFT_VOCAB_KEY, None)


def attach_target_embeddings(draft: LlamaForCausalLM, embed: torch.Tensor, head: torch.Tensor | None) -> None:
    """Make ``draft`` use ``embed`` / ``head`` (``[vocab, hidden]``) by reference (no copy)."""
    embed_param = embed if isinstance(embed, torch.nn.Parameter) else torch.nn.Parameter(embed, requires_grad=False)
    draft.model.embed_tokens.weight = embed_param
    if head is None or head.data_ptr() == embed.data_ptr():
        draft.lm_head.weight = embed_param
    else:
        draft.lm_head.weight = head if isinstance(head, torch.nn.Parameter) else torch.nn.Parameter(head, requires_grad=False)


def own_state_dict(draft: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The draft's own weights only (decoder layers + final norm), contiguous CPU tensors."""
    return {
        k: v.detach().to("cpu").contiguous()
        for k, v in draft.state_dict().items()
        if k.startswith(OWN_WEIGHT_PREFIXES)
    }


def save_draft(draft: LlamaForCausalLM, out_dir: str, meta: DraftMeta, dtype: torch.dtype | None = None) -> None:
    """Write ``out_dir`` (config, own weights in ``dtype`` or the draft's dtype, metadata)."""
    os.makedirs(out_dir, exist_ok=True)
    weights = own_state_dict(draft)
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    ids = draft_vocab_ids(draft)
    if ids is not None:
        weights[DRAFT_VOCAB_KEY] = ids.detach().to("cpu", torch.int64).contiguous()
    if (meta.draft_vocab_size or None) != (None if ids is None else ids.numel()):
        raise ValueError(f"meta.draft_vocab_size={meta.draft_vocab_size} does not match the draft's head")
    write_draft_weights(weights, out_dir)
    draft.config.save_pretrained(out_dir)
    with open(os.path.join(out_dir, DRAFT_META_FILE), "w", encoding="utf-8") as f:
        json.dump(asdict(meta), f, indent=2)
        f.write("\n")


def make_truncated_draft(target_dir: str, layers: list[int], out_dir: str) -> DraftMeta:
    """Write an untrained draft made of target layers ``layers`` (HF safetensors target dir).

    Returns the written :class:`DraftMeta`. Raises ValueError on bad ``layers``.
    """
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = build_draft_from_target(target, layers)
    meta = DraftMeta(
        target=os.path.abspath(target_dir),
        target_fingerprint=embedding_fingerprint(target.model.embed_tokens.weight),
        num_layers=len(layers),
        init_layers=tuple(layers),
    )
    save_draft(draft, out_dir, meta)
    return meta


def resolve_target_dir(meta: DraftMeta, draft_dir: str) -> str:
    """HF dir of the draft's target: a path (absolute or relative to ``draft_dir``) or an alias.

    Aliases and GGUF targets go through ``specdec.models.resolve.resolve_model_dir``.
    """
    for candidate in (meta.target, os.path.join(draft_dir, meta.target)):
        if os.path.isdir(candidate) and meta.target_gguf_file is None:
            return candidate
    return resolve_model_dir(ModelConfig(model=meta.target, gguf_file=meta.target_gguf_file))


def load_draft(
    draft_dir: str,
    model_cfg=None,
    *,
    target_model: PreTrainedModel | None = None,
    target_dir: str | None = None,
    attn_implementation: str | None = None,
) -> LlamaForCausalLM:
    """Build the draft ``LlamaForCausalLM`` of ``draft_dir`` with the target's embeddings/head.

    Args:
        draft_dir: a draft directory (see module doc).
        model_cfg: ``specdec.config.ModelConfig`` giving ``dtype`` and ``device`` (None: fp32 CPU).
        target_model: an already loaded target whose embeddings are shared (no file read).
        target_dir: HF dir of the target (overrides the alias/path in the metadata).
        attn_implementation: attention implementation name set on the draft's config copy
            (the engine's loader passes its slot-cache attention here).
    Returns:
        the draft in ``eval()`` mode; ``embed_tokens.weight`` is ``lm_head.weight`` when tied.
    Raises:
        IncompatibleDraftError: the target's embeddings do not match the recorded fingerprint.
        ValueError: ``target_model`` has another dtype/device than ``model_cfg``.
        FileNotFoundError: missing draft files or target embeddings.
    """
    meta = read_meta(draft_dir)
    if target_model is not None:
        embed, head = target_model.get_input_embeddings().weight, target_model.get_output_embeddings().weight
    else:
        embed, head = read_target_embeddings(target_dir or resolve_target_dir(meta, draft_dir))
    check_fingerprint(meta.target_fingerprint, embed)
    dtype = model_cfg.torch_dtype if model_cfg is not None else torch.float32
    device = model_cfg.device if model_cfg is not None else "cpu"
    if target_model is not None and (embed.dtype != dtype or embed.device.type != torch.device(device).type):
        raise ValueError(f"model_cfg dtype/device ({dtype}, {device}) must equal the shared target's "
                         f"({embed.dtype}, {embed.device}) to share its embeddings by reference")
    config = AutoConfig.from_pretrained(draft_dir)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.device("meta"):
        draft = LlamaForCausalLM(config)
    draft.to_empty(device=device)
    own = read_draft_weights(draft_dir)
    vocab_ids = own.pop(DRAFT_VOCAB_KEY, None)
    own = {k: v.to(dtype) for k, v in own.items()}
    if (vocab_ids is None) != (meta.draft_vocab_size is None) or (
            vocab_ids is not None and vocab_ids.numel() != meta.draft_vocab_size):
        raise ValueError(f"{draft_dir}: '{DRAFT_VOCAB_KEY}' does not match draft_vocab_size={meta.draft_vocab_size}")
    draft.to(dtype)
    missing, _ = draft.load_state_dict(own, strict=False, assign=True)
    _check_missing(missing)
    if target_model is None:
        embed, head = embed.to(device, dtype), None if head is None else head.to(device, dtype)
    attach_target_embeddings(draft, embed, head)
    if vocab_ids is not None:
        set_draft_vocab(draft, vocab_ids)
    with torch.device(device):  # non-persistent inv_freq buffer was left on the meta device
        draft.model.rotary_emb = type(draft.model.rotary_emb)(config=config)
    return draft.to(device).eval()


def _check_missing(missing: list[str]) -> None:
    unexpected_missing = [k for k in missing if k.startswith(OWN_WEIGHT_PREFIXES)]
    if unexpected_missing:
        raise FileNotFoundError(f"draft weights missing from the weight files: {unexpected_missing[:4]}")
