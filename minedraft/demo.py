"""``minedraft demo`` (``make demo``): ar, sd and psd on the same models, prompts and machine.

For each mode: start the stack (``minedraft.launcher.Stack``), run the prompts
(``minedraft.prompts``), stop the stack. Then print output tokens/s, mean acceptance length,
TTFT and latency side by side, with throughput ratios to ``ar`` and to ``sd`` (DESIGN.md §8),
and write ``<out_dir>/results.json`` plus each mode's per-request outputs. At temperature 0
the outputs of every mode are compared with ``ar``'s (speculative decoding is lossless; float
rounding of different batch shapes can still flip a near-tie argmax).
"""
from __future__ import annotations

import os
import sys

from specdec.sample.bench_only import fixed_acceptance_label
from minedraft.launcher import Stack, resolve_model_dir
from minedraft.prompts import PromptsConfig, format_metrics, results_as_records, run_prompts, write_json
from minedraft.stack import StackConfig

TABLE_COLUMNS = (("output_tokens_per_s", "tok/s"), ("mean_acceptance_length", "accept len"),
                 ("ttft_ms_p50", "TTFT p50 ms"), ("latency_ms_p50", "lat p50 ms"),
                 ("latency_ms_p99", "lat p99 ms"))


def _run_mode(cfg: StackConfig, model_dir: str, prompts_cfg: PromptsConfig, out_dir: str) -> tuple[dict, list]:
    print(f"\n=== mode {cfg.mode} ===", flush=True)
    with Stack(cfg) as stack:
        stack.start(model_dir)
        metrics, results = run_prompts(prompts_cfg)
    metrics["logs"] = stack.run_dir
    records = results_as_records(results)
    write_json(os.path.join(out_dir, f"outputs_{cfg.mode}.json"), records)
    print(format_metrics(metrics), flush=True)
    return metrics, records


def format_table(by_mode: dict[str, dict]) -> str:
    """A text table of the modes side by side, with throughput ratios to ar and sd."""
    header = f"{'mode':<6}" + "".join(f"{title:>14}" for _, title in TABLE_COLUMNS) + f"{'vs ar':>8}{'vs sd':>8}"
    lines = [header, "-" * len(header)]
    for mode, m in by_mode.items():
        row = f"{mode:<6}" + "".join(f"{m[key]:>14.2f}" for key, _ in TABLE_COLUMNS)
        for base in ("ar", "sd"):
            ref = by_mode.get(base, {}).get("output_tokens_per_s")
            row += f"{m['output_tokens_per_s'] / ref:>7.2f}x" if ref else f"{'-':>8}"
        lines.append(row)
    return "\n".join(lines)


def format_identity(by_mode: dict[str, dict]) -> str:
    """One line: how many greedy outputs of each mode equal ``ar``'s, or why none were compared
    (no ar, only ar, or ``run_demo`` did not compare: temperature > 0 or --bench-fixed-acceptance)."""
    if "ar" not in by_mode:
        return "outputs not compared: ar, the reference, was not among the modes"
    if len(by_mode) == 1:
        return "outputs not compared: only ar ran, no speculative mode to compare with it"
    counts = {mode: m["num_outputs_equal_to_ar"] for mode, m in by_mode.items()
              if mode != "ar" and "num_outputs_equal_to_ar" in m}
    if not counts:
        return "outputs not compared with ar's (needs temperature 0 and no --bench-fixed-acceptance)"
    return "greedy outputs equal to ar's: " + ", ".join(
        f"{mode} {num}/{by_mode[mode]['num_requests']}" for mode, num in counts.items())


def _num_equal_outputs(records: list[dict], reference: list[dict]) -> int:
    return sum(a["token_ids"] == b["token_ids"] for a, b in zip(records, reference))


def run_demo(args, stack_cfgs: list[StackConfig]) -> int:
    """Runs every mode in turn; returns 0, or 1 when a stack failed."""
    prompts_cfg = PromptsConfig(path=args.prompts_file, gateway=f"{args.host}:{args.port}", limit=args.limit,
                                concurrency=args.concurrency, max_tokens=args.max_tokens,
                                temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos,
                                api_key=args.api_key or os.environ.get("MINEDRAFT_API_KEY", ""))
    model_dir = resolve_model_dir(stack_cfgs[0].target)
    by_mode: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    try:
        for cfg in stack_cfgs:
            by_mode[cfg.mode], outputs[cfg.mode] = _run_mode(cfg, model_dir, prompts_cfg, args.out_dir)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    cfg = stack_cfgs[0]
    if "ar" in outputs and args.temperature == 0 and cfg.bench_fixed_acceptance is None:
        for mode, records in outputs.items():
            by_mode[mode]["num_outputs_equal_to_ar"] = _num_equal_outputs(records, outputs["ar"])
    config = {"limit": args.limit, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "k": args.k, "max_num_seqs": args.max_num_seqs,
              "target": args.target, "draft": args.draft or "(default)", "cpu_count": os.cpu_count(),
              "device": cfg.device, "dtype": cfg.dtype, "verifier_gpus": list(cfg.placement.resolved_verifier_gpus),
              "drafter_gpu": cfg.placement.resolved_drafter_gpu}
    if cfg.bench_fixed_acceptance is not None:  # BENCHMARK-ONLY: every output says so
        config["benchmark_only"] = fixed_acceptance_label(cfg.bench_fixed_acceptance)
        print(f"\n*** {config['benchmark_only']}: acceptance is fixed, outputs are not the target's ***")
    write_json(os.path.join(args.out_dir, "results.json"), {"config": config, "modes": by_mode})
    print("\n" + format_table(by_mode))
    print(format_identity(by_mode))
    print(f"\nresults: {os.path.join(args.out_dir, 'results.json')}")
    return 0
