"""Export the target and our draft as plain Hugging Face dirs that vLLM can load (issue 8).

- Target: the loader's cached conversion (``python -m specdec.models.loader resolve``) already is a plain
  HF dir (config.json, model.safetensors, tokenizer); it is linked file by file.
- Draft: a MineDraft draft dir stores only its own decoder layers and final norm (and, with an
  FR-Spec reduced vocabulary, ``draft_vocab_ids``); the embeddings and LM head are the target's
  (``specdec.models.draft_format``). vLLM needs a standalone ``LlamaForCausalLM``, so the export writes
  the draft's own layers + the target's ``embed_tokens`` + the target's FULL LM head (tied, as in
  the target; an untied ``lm_head.weight`` is copied). NOTE: vLLM's draft therefore scores the
  full 49152-id vocabulary, while our drafter uses the FR-Spec head of ``draft_vocab_size`` ids
  (Zhao et al. 2025, arXiv 2502.14856, Sec. 3); the export records this in ``minedraft_export.json``.

Used by the vLLM drafter (``specdec.vllm_backend.models``) and by ``python -m bench.engines.export_hf``.
"""
from __future__ import annotations

import json
import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")
EXPORT_META_FILE = "minedraft_export.json"
FULL_HEAD_NOTE = ("vLLM's draft uses the FULL target vocabulary LM head; our drafter uses the FR-Spec "
                  "reduced head of {n} ids")


def export_target(target_dir: str, out_dir: str) -> str:
    """Link (or copy across file systems) every file of the HF dir ``target_dir`` into ``out_dir``.

    Raises:
        FileNotFoundError: ``target_dir`` has no config.json or no safetensors file.
    """
    names = os.listdir(target_dir)
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise FileNotFoundError(f"target_dir: {target_dir} is not an HF dir with config.json + safetensors")
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        _link_or_copy(os.path.join(target_dir, name), os.path.join(out_dir, name))
    return out_dir


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.lexists(dst):
        os.remove(dst)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def export_draft(draft_dir: str, target_dir: str, out_dir: str) -> dict:
    """Write a standalone HF ``LlamaForCausalLM`` of the draft in ``draft_dir`` into ``out_dir``.

    Weights (float32 as stored): the draft's ``model.layers.*`` and ``model.norm.weight``, the target's
    ``model.embed_tokens.weight`` ``[vocab, hidden]`` and, if the target's head is untied, its
    ``lm_head.weight`` ``[vocab, hidden]``. Tokenizer files are copied from ``target_dir``.

    Returns:
        the export metadata written to ``minedraft_export.json`` (draft vocab size, full-head note).
    Raises:
        FileNotFoundError: missing draft files or target embeddings.
        IncompatibleDraftError: the target is not the one the draft was trained on.
    """
    import torch  # noqa: F401  (safetensors' torch API)
    from safetensors.torch import save_file

    from specdec.models.draft_format import (DRAFT_VOCAB_KEY, LM_HEAD_KEY, check_fingerprint, read_draft_weights,
                                      read_meta, read_target_embeddings)

    meta = read_meta(draft_dir)
    embed, head = read_target_embeddings(target_dir)
    check_fingerprint(meta.target_fingerprint, embed)
    tensors = {k: v.contiguous() for k, v in read_draft_weights(draft_dir).items() if k != DRAFT_VOCAB_KEY}
    dtype = next(iter(tensors.values())).dtype
    tensors["model.embed_tokens.weight"] = embed.to(dtype).contiguous()
    if head is not None:
        tensors[LM_HEAD_KEY] = head.to(dtype).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(draft_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["tie_word_embeddings"] = head is None
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(target_dir, name)):
            shutil.copy2(os.path.join(target_dir, name), os.path.join(out_dir, name))
    export_meta = {"source_draft": os.path.abspath(draft_dir), "target": os.path.abspath(target_dir),
                   "num_layers": meta.num_layers, "our_draft_vocab_size": meta.draft_vocab_size,
                   "exported_vocab_size": int(embed.shape[0]),
                   "note": FULL_HEAD_NOTE.format(n=meta.draft_vocab_size or int(embed.shape[0]))}
    with open(os.path.join(out_dir, EXPORT_META_FILE), "w", encoding="utf-8") as f:
        json.dump(export_meta, f, indent=2)
    return export_meta
