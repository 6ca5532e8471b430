"""Greedy identity of sd / psd against ar in one dtype (in process, ``reference.loop``'s loop).

Runs ``reference.loop``'s ``ReferenceLoop`` for ``ar``, ``sd`` and ``psd`` on the same
Spec-Bench prompts at temperature 0 and counts, against ``ar``, the requests whose output token
ids differ and the output tokens after each request's first divergence. Speculative decoding
is lossless in exact arithmetic; in bfloat16 the verify step (k + 1 tokens per row) and the
one-token decode step run differently shaped kernels that are not batch invariant, so at
near-ties their argmax can differ (vLLM has the same property). Issue 8.

Usage:
    python -m bench.cpu.cpu_step_identity --dtype bfloat16 --limit 16 --max-tokens 64
        [--out bench/results/cpu_step_identity_bfloat16.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from reference import loop as gen
from reference import cli as gen_cli

MODES = ("ar", "sd", "psd")


def run_mode(mode: str, args: argparse.Namespace) -> tuple[dict[str, list[int]], dict]:
    """Output token ids per request id, and the loop's throughput/acceptance stats."""
    from transformers import AutoTokenizer

    gen_args = gen_cli.parse_args(["--mode", mode, "--k", str(args.k), "--limit", str(args.limit),
                                "--max-tokens", str(args.max_tokens), "--temperature", "0",
                                "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)])
    target, drafter, tokenizer_dir = gen_cli.build_workers(gen_args)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    requests = []
    for i, text in enumerate(gen_cli.read_prompts(gen_args.prompts, args.limit)):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        params = gen.SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        requests.append(gen.Request(f"req-{i}", list(ids), params))
    stats = gen.ReferenceLoop(gen.LoopConfig(mode, args.k, args.max_num_seqs), target,
                              drafter).run(requests)
    outputs = {r.request_id: list(r.output_token_ids) for r in requests}
    summary = {"output_tokens": stats.num_output_tokens, "elapsed_s": round(stats.elapsed_s, 2),
               "output_tokens_per_s": round(stats.output_tokens_per_s, 2),
               "mean_acceptance_length": round(stats.mean_acceptance_length, 3)}
    return outputs, summary


def compare(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict:
    """Mismatching requests and tokens of ``other`` against ``reference``.

    A token mismatches when it lies at or after the request's first differing position (after a
    divergence the two continuations condition on different prefixes); length differences count.
    """
    mismatched_ids, num_tokens, num_bad_tokens = [], 0, 0
    for request_id, ref in reference.items():
        out = other[request_id]
        num_tokens += len(ref)
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b),
                     min(len(ref), len(out)))
        bad = max(len(ref), len(out)) - first
        if bad:
            mismatched_ids.append(request_id)
            num_bad_tokens += bad
    return {"num_requests": len(reference), "num_mismatched_requests": len(mismatched_ids),
            "mismatched_request_ids": mismatched_ids, "num_reference_tokens": num_tokens,
            "num_tokens_after_first_divergence": num_bad_tokens}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out", default=None, help="json path (default "
                        "bench/results/cpu_step_identity_<dtype>.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    outputs, stats = {}, {}
    for mode in MODES:
        outputs[mode], stats[mode] = run_mode(mode, args)
        print(f"{mode}: {stats[mode]}", flush=True)
    result = {"command": "python -m bench.cpu.cpu_step_identity " + " ".join(argv or __import__("sys").argv[1:]),
              "dtype": args.dtype, "k": args.k, "limit": args.limit, "max_tokens": args.max_tokens,
              "stats": stats,
              "vs_ar": {mode: compare(outputs["ar"], outputs[mode]) for mode in ("sd", "psd")}}
    out = Path(args.out or f"bench/results/cpu_step_identity_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["vs_ar"], indent=2))
    return result


if __name__ == "__main__":
    main()
