"""Markdown table of ``bench/gpu/gpu_step.py`` results (every random-weight row says so)."""

from __future__ import annotations


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_markdown(result: dict) -> str:
    """The report as Markdown: machine, bandwidth floor, step table, greedy identity, errors."""
    machine, bw = result["machine"], result["bandwidth"]
    device = machine.get("gpu") or f"CPU {machine.get('cpu')} x{machine.get('threads')} threads"
    lines = [
        "# GPU engine step: eager vs CUDA graphs",
        "",
        f"- machine: {device}; torch {machine['torch']}, transformers {machine['transformers']};"
        f" {machine['date_utc']}",
        f"- command: `{result['command']}`",
        f"- settings: {result['settings']}",
        f"- measured bandwidth: copy {bw['copy_gb_per_s']:.0f} GB/s (read + write), read-only sum"
        f" {bw['read_sum_gb_per_s']:.0f} GB/s; floor = step read bytes / "
        f"{bw['best_gb_per_s']:.0f} GB/s",
        "- step = one `ModelRunner.forward` (host prep + forward + float32 logits + sync),"
        " median; decode = 1 token/row (a draft step is a decode step of the draft model),"
        " verify = k + 1 tokens/row",
        "",
        "| model | weights | step | batch | eager ms | fast path | fast ms | speedup |"
        " floor ms | fast / floor | logits rel. diff | argmax agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for info in result["models"]:
        for row in info["steps"]:
            lines.append(
                f"| {info['model']} ({info['dtype']}) | {info['weights']} | {row['kind']}"
                f" ({row['tokens_per_row']}/row) | {row['batch']} | {_fmt(row['eager_ms'])} |"
                f" {row['fast_mode']} | {_fmt(row['fast_ms'])} | {_fmt(row['speedup'], 1)}x |"
                f" {_fmt(info['floor_ms'], 3)} | {_fmt(row['fast_over_floor'])} |"
                f" {row['logits_rel_diff']:.1e} | {row['argmax_agreement']:.3f} |")
    for info in result["models"]:
        for key, value in info.items():
            if key.startswith("capture_error") and value:
                lines.append(f"\nCUDA graph capture failed for {info['model']} ({key}; ran the"
                             f" static path eagerly): {value}")
    identity = result.get("greedy_identity")
    if identity:
        lines += ["", f"Greedy identity (random weights; target {identity['target']} float32,"
                  f" {identity['num_requests']} requests x {identity['max_tokens']} tokens,"
                  f" k={identity['k']}, CUDA graphs on: {identity['graphs']}): sd and psd equal"
                  f" ar: **{identity['is_equal']}**", "",
                  "| draft | mode | mean acceptance length | mismatched requests |",
                  "|---|---|---|---|"]
        lines += [f"| {r['draft']} | {r['mode']} | {r['mean_acceptance_length']:.2f} |"
                  f" {r['mismatched_requests'] or 'none'} |" for r in identity["runs"]]
    if result["errors"]:
        lines += ["", "Errors:"] + [f"- {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"
