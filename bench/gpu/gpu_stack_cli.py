"""Command line of bench/gpu/gpu_stack.py (see its docstring) and the machine description."""
from __future__ import annotations

import argparse
import subprocess

MODES = ("ar", "sd", "psd")
PARTS = ("a", "b", "c", "d")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.gpu_stack", description="The MineDraft stack on GPUs: ar, sd, psd through the gateway")
    p.add_argument("--out-dir", required=True, help="results.json and results.md go here")
    p.add_argument("--logs-dir", default="runs/gpu_stack", help="service logs")
    p.add_argument("--parts", default="a,b,c,d", help=f"subset of {','.join(PARTS)}")
    p.add_argument("--modes", default="ar,sd,psd", help="modes of parts a and c")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default=None, help="parts a/b engine dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--paper-dtype", default=None, help="parts c/d engine dtype (default as --dtype)")
    p.add_argument("--drafter-gpu", type=int, choices=(0, 1), default=1,
                   help="the drafter's GPU in parts a/c (0: shares the verifier's GPU, one-GPU machines)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="parts a/b target (alias, dir or .gguf)")
    p.add_argument("--draft", default="drafts/smollm2-135m-instruct", help="parts a/b draft dir")
    p.add_argument("--paper-target", default="random:llama-8b", help="parts c/d target")
    p.add_argument("--paper-draft", default="random:qwen3-0.6b", help="parts c/d draft")
    p.add_argument("--fixed-acceptance", type=float, default=0.7,
                   help="parts c/d: BENCHMARK-ONLY --bench-fixed-acceptance P of the verifier")
    p.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl", help="Spec-Bench jsonl")
    p.add_argument("--limit", type=int, default=64, help="prompts per run")
    p.add_argument("--spread", action="store_true",
                   help="take the --limit rows evenly spaced through --prompts (every category) instead of the first")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-num-seqs", type=int, default=8, help="m (2m requests in flight per run)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--time-budget-s", type=float, default=480.0, help="skip what would start after this")
    p.add_argument("--min-run-s", type=float, default=25.0, help="a run starts only if this much is left")
    p.add_argument("--startup-timeout-s", type=float, default=240.0)
    args = p.parse_args(argv)
    args.parts = tuple(x for x in args.parts.split(",") if x)
    args.modes = tuple(x for x in args.modes.split(",") if x)
    unknown = [x for x in args.parts if x not in PARTS] + [x for x in args.modes if x not in MODES]
    if unknown:
        p.error(f"--parts/--modes: unknown {unknown}")
    return args


def gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
