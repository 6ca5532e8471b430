"""``python -m bench.engines.export_hf``: the target and our draft as plain Hugging Face dirs for vLLM.

The export itself is ``specdec.models.hf_export`` (also used by the vLLM drafter); this is its CLI.

Usage::

    python -m bench.engines.export_hf --out-dir runs/vllm_export            # default target and draft
    python -m bench.engines.export_hf --target DIR --draft DIR --out-dir OUT

Writes ``OUT/target`` and ``OUT/draft``; prints both paths as JSON.
"""
from __future__ import annotations

import argparse
import json
import os

from specdec.models.hf_export import EXPORT_META_FILE, export_draft, export_target  # noqa: F401  (re-exported)


def export_all(target: str, draft: str, out_dir: str) -> dict:
    """Export target and draft under ``out_dir``; returns ``{"target", "draft", "draft_meta"}`` paths/meta."""
    from minedraft.launcher import resolve_model_dir
    from minedraft.stack import StackConfig, resolve_draft_dir

    target_dir = resolve_model_dir(target)
    draft_dir = resolve_draft_dir(StackConfig(target=target, draft=draft), target_dir)
    out_target = export_target(target_dir, os.path.join(out_dir, "target"))
    draft_meta = export_draft(draft_dir, target_dir, os.path.join(out_dir, "draft"))
    return {"target": os.path.abspath(out_target), "draft": os.path.abspath(os.path.join(out_dir, "draft")),
            "draft_meta": draft_meta}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines.export_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="target alias, HF dir or GGUF")
    parser.add_argument("--draft", default="", help="draft dir (default: the launcher's default draft)")
    parser.add_argument("--out-dir", default="runs/vllm_export")
    args = parser.parse_args(argv)
    print(json.dumps(export_all(args.target, args.draft, args.out_dir), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
