"""Model loading: any model spec -> a causal LM in eval mode with the slot-cache attention.

``load_model`` resolves the spec (``specdec.models.resolve.resolve_model_dir``: aliases, local HF
dirs, GGUF files converted once and cached, random specs), then loads an HF dir with
transformers, a MineDraft draft dir with ``specdec.models.draft_format.load_draft`` and a random
spec with ``specdec.models.random_models.build_random_model``. Nothing is ever downloaded from a
model hub (``local_files_only=True`` everywhere).

CLI (used by the launcher and the torch-free gateway)::

    python -m specdec.models.loader resolve smollm2-135m-instruct   # prints the HF dir
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

from specdec.config import ModelConfig
from specdec.errors import IncompatibleDraftError
from specdec.kv.kv_cache import SLOT_ATTENTION_NAME
from specdec.models.gguf import DEFAULT_TARGET, DRAFT_FORMAT_MARKER
from specdec.models.random_models import build_random_model, read_marker
from specdec.models.resolve import resolve_model_dir

MAX_MISMATCH_EXAMPLES = 5


def use_slot_attention(model) -> None:
    """Switch ``model`` to the slot-cache attention on its own copy of the config.

    Configs can be shared between models, so the config object is deep-copied and the copy is
    given to every submodule that referenced the original before the switch.
    """
    old_config = model.config
    new_config = copy.deepcopy(old_config)
    for module in model.modules():
        if getattr(module, "config", None) is old_config:
            module.config = new_config
    model.set_attn_implementation(SLOT_ATTENTION_NAME)


def load_model(cfg: ModelConfig):
    """Load ``cfg.model`` in eval mode with ``cfg.dtype``/``cfg.device`` and slot attention.

    Dirs with ``minedraft_draft.json`` are loaded by ``specdec.models.draft_format.load_draft``; random
    specs (dirs with ``minedraft_random.json``) are built with seeded random weights directly on
    ``cfg.device`` by ``specdec.models.random_models.build_random_model``.

    Returns:
        a ``transformers.PreTrainedModel`` (causal LM).
    """
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(cfg)
    random_marker = read_marker(model_dir)
    if random_marker is not None:
        model = build_random_model(random_marker["spec"], cfg.torch_dtype, cfg.device)
        use_slot_attention(model)
        return model
    if os.path.isfile(os.path.join(model_dir, DRAFT_FORMAT_MARKER)):
        from specdec.models.draft_format import load_draft  # transformers' Llama classes: only for a draft

        model = load_draft(model_dir, cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=cfg.torch_dtype, local_files_only=True
        )
    model = model.to(device=cfg.device, dtype=cfg.torch_dtype).eval()
    use_slot_attention(model)
    return model


def check_vocab_compat(target_tok_dir: str, draft_tok_dir: str) -> None:
    """Check that the draft tokenizer maps every one of its tokens to the target's id.

    A draft vocab that is a prefix/subset of the target's (e.g. only padded to a smaller
    embedding size) is accepted; the caller pads draft probabilities with zeros up to the
    target's vocab size. Speculative sampling (Leviathan et al. 2023, Sec. 2.3) compares
    ``q(x)`` and ``p(x)`` per token id, so ids must agree.

    Raises:
        IncompatibleDraftError: some draft token is missing in the target vocab or has another id.
    """
    from transformers import AutoTokenizer

    target_vocab = AutoTokenizer.from_pretrained(target_tok_dir, local_files_only=True).get_vocab()
    draft_vocab = AutoTokenizer.from_pretrained(draft_tok_dir, local_files_only=True).get_vocab()
    mismatches = [
        (token, draft_id, target_vocab.get(token))
        for token, draft_id in sorted(draft_vocab.items(), key=lambda item: item[1])
        if target_vocab.get(token) != draft_id
    ]
    if mismatches:
        examples = ", ".join(
            f"{token!r}: draft id {draft_id}, target id {target_id}"
            for token, draft_id, target_id in mismatches[:MAX_MISMATCH_EXAMPLES]
        )
        raise IncompatibleDraftError(
            f"draft tokenizer {draft_tok_dir} is incompatible with target tokenizer "
            f"{target_tok_dir}: {len(mismatches)} of {len(draft_vocab)} draft tokens are missing "
            f"in the target vocab or have other ids (e.g. {examples})"
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.models.loader resolve MODEL [--gguf-file F]``: print the HF dir."""
    parser = argparse.ArgumentParser(
        prog="python -m specdec.models.loader", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    resolve = commands.add_parser(
        "resolve", help="print the local HF dir of MODEL (converting a GGUF once)"
    )
    resolve.add_argument("model", nargs="?", default=DEFAULT_TARGET)
    resolve.add_argument("--gguf-file", default=None)
    args = parser.parse_args(argv)
    try:
        print(resolve_model_dir(ModelConfig(model=args.model, gguf_file=args.gguf_file)))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
