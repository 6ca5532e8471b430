"""Ratios, greedy-output check, Markdown table and PNG plots of a benchmark-suite run (issue 8).

Input: the suite's run records (``bench.common.suite``), each ``{"system", "family", "mode", "m", "k",
"temperature", "metrics": bench.common.stats.summarize(...), "step_split", ...}``.
"""
from __future__ import annotations

import math

from bench.common.stats import ratio

OURS_VS_VLLM = (("ar", "vllm-ar"), ("sd", "vllm-sd"), ("psd", "vllm-sd"))
RATIO_PAIRS = (("psd", "sd"), ("psd", "ar"), ("psd", "sd-2core"), ("sd", "ar"),
               ("psd-adaptive", "psd"), ("auto", "psd"), ("auto", "ar")) + OURS_VS_VLLM
TABLE_COLUMNS = (("output_tokens_per_s", "out tok/s", 2), ("requests_per_s", "req/s", 3),
                 ("ttft_ms_p50", "TTFT p50 ms", 0), ("ttft_ms_p99", "TTFT p99 ms", 0),
                 ("latency_ms_p50", "lat p50 ms", 0), ("latency_ms_p99", "lat p99 ms", 0),
                 ("mean_acceptance_length", "accept len", 2), ("num_cores", "cores", 0),
                 ("output_tokens_per_s_per_core", "tok/s/core", 2))
SPLIT_COLUMNS = ("draft_ms", "verify_ms", "data_plane_ms", "idle_ms", "wall_ms")


def workload_key(run: dict) -> tuple:
    """(temperature, m) -- the load; k is a system setting inside it."""
    return run["temperature"], run["m"]


def _find(runs: list[dict], system: str, temperature: float, m: int, k: int | None) -> dict | None:
    for run in runs:
        if run["system"] == system and workload_key(run) == (temperature, m) and (run["k"] in (k, None)):
            return run
    return None


def compute_ratios(runs: list[dict]) -> list[dict]:
    """Output-tokens/s ratios per (temperature, m, k): ``RATIO_PAIRS`` where both ran, plus the best
    of ours over the best of vLLM (by output tokens/s, any k). Systems without speculation (k None)
    pair with every k."""
    out = []
    ks = sorted({r["k"] for r in runs if r["k"] is not None}) or [None]
    for temperature, m in sorted({workload_key(r) for r in runs}):
        for k in ks:
            for num, den in RATIO_PAIRS:
                a, b = _find(runs, num, temperature, m, k), _find(runs, den, temperature, m, k)
                if a and b and (a["k"] is not None or b["k"] is not None or k == ks[0]):
                    out.append({"temperature": temperature, "m": m, "k": a["k"] if a["k"] is not None else b["k"],
                                "ratio": f"{num}/{den}", "output_tokens_per_s": ratio(
                                    a["metrics"]["output_tokens_per_s"], b["metrics"]["output_tokens_per_s"]),
                                "latency_ms_p50": ratio(a["metrics"]["latency_ms_p50"], b["metrics"]["latency_ms_p50"])})
        best = {}
        for family in ("ours", "vllm"):
            runs_f = [r for r in runs if r["family"] == family and workload_key(r) == (temperature, m)]
            if runs_f:
                best[family] = max(runs_f, key=lambda r: r["metrics"]["output_tokens_per_s"])
        if len(best) == 2:
            out.append({"temperature": temperature, "m": m, "k": None,
                        "ratio": f"best-ours({_label(best['ours'])})/best-vllm({_label(best['vllm'])})",
                        "output_tokens_per_s": ratio(best["ours"]["metrics"]["output_tokens_per_s"],
                                                     best["vllm"]["metrics"]["output_tokens_per_s"]),
                        "latency_ms_p50": ratio(best["ours"]["metrics"]["latency_ms_p50"],
                                                best["vllm"]["metrics"]["latency_ms_p50"])})
    return _dedupe(out)


def _dedupe(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        key = (row["temperature"], row["m"], row["k"], row["ratio"])
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def _label(run: dict) -> str:
    return run["system"] if run["k"] is None else f"{run['system']} k={run['k']}"


def greedy_check(runs: list[dict], outputs: dict[str, dict[str, str]]) -> list[dict]:
    """At temperature 0, compare each speculative system's texts with its family's ``ar``
    (ours: ``ar``; vLLM: ``vllm-ar``) per prompt id, and ours ``ar`` with ``vllm-ar``
    (informational: different kernels can flip near-tie argmaxes). ``outputs``: run id ->
    {prompt id: text}."""
    out = []
    for run in runs:
        if run["temperature"] != 0:
            continue
        references = {"ours": "ar", "vllm": "vllm-ar"}
        ref_system = references[run["family"]] if run["system"] not in references.values() else None
        if run["system"] == "ar":
            ref_system = "vllm-ar"
        ref = _find(runs, ref_system, 0, run["m"], None) if ref_system else None
        if ref is None:
            continue
        mine, theirs = outputs[run["run_id"]], outputs[ref["run_id"]]
        common = sorted(set(mine) & set(theirs))
        mismatched = [p for p in common if mine[p] != theirs[p]]
        out.append({"run_id": run["run_id"], "reference": ref["run_id"], "num_compared": len(common),
                    "num_equal": len(common) - len(mismatched), "mismatched_prompt_ids": mismatched})
    return out


def _fmt(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown(meta: dict, runs: list[dict], ratios: list[dict], checks: list[dict]) -> str:
    """The results as Markdown: header (machine, date, commit, command, notes), one table per
    workload, step-time split, ratios, greedy check."""
    lines = [f"# Benchmark suite: {meta['name']}", "",
             f"- date (UTC): {meta['date_utc']}; git commit: {meta['git_commit']}",
             f"- machine: {meta['machine']}", f"- command: `{meta['command']}`",
             f"- workload: {meta['workload']}"]
    lines += [f"- note: {note}" for note in meta["notes"]] + [""]
    for temperature, m in sorted({workload_key(r) for r in runs}):
        lines += [f"## temperature {temperature}, m = {m} (concurrency {2 * m}, {2 * m} requests resident)", "",
                  "| system | k | " + " | ".join(t for _, t, _ in TABLE_COLUMNS) + " | errors |",
                  "|---|---|" + "---|" * (len(TABLE_COLUMNS) + 1)]
        for run in (r for r in runs if workload_key(r) == (temperature, m)):
            cells = [_fmt(run["metrics"][key], d) for key, _, d in TABLE_COLUMNS]
            lines.append(f"| {run['system']} | {run['k'] if run['k'] is not None else '-'} | "
                         + " | ".join(cells) + f" | {run['metrics']['num_errors']} |")
        lines.append("")
    lines += _task_table(runs)
    split_runs = [r for r in runs if r.get("step_split")]
    if split_runs:
        lines += ["## Step-time split (ours, mean ms per coordinator step)", "",
                  "| system | T | m | k | " + " | ".join(SPLIT_COLUMNS) + " | steps | parallel-step ratio |",
                  "|---|---|---|---|" + "---|" * (len(SPLIT_COLUMNS) + 2)]
        for run in split_runs:
            s = run["step_split"]
            lines.append(f"| {run['system']} | {run['temperature']} | {run['m']} | {run['k'] or '-'} | "
                         + " | ".join(_fmt(s[c], 1) for c in SPLIT_COLUMNS)
                         + f" | {s['num_steps']} | {_fmt(s['parallel_step_ratio'], 2)} |")
        lines.append("")
    if ratios:
        lines += ["## Ratios (output tokens/s; end-to-end latency p50)", "",
                  "| T | m | k | ratio | tok/s | latency p50 |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['temperature']} | {r['m']} | {r['k'] if r['k'] is not None else '-'} | {r['ratio']} | "
                  f"{_fmt(r['output_tokens_per_s'], 2)}x | {_fmt(r['latency_ms_p50'], 2)}x |" for r in ratios]
        lines.append("")
    if checks:
        lines += ["## Greedy outputs (temperature 0) compared with the reference", "",
                  "| run | reference | equal / compared | mismatched prompt ids |", "|---|---|---|---|"]
        lines += [f"| {c['run_id']} | {c['reference']} | {c['num_equal']} / {c['num_compared']} | "
                  f"{', '.join(c['mismatched_prompt_ids'][:10]) or '-'} |" for c in checks]
        lines.append("")
    return "\n".join(lines)


def _task_table(runs: list[dict]) -> list[str]:
    """Per Spec-Bench task: mean acceptance length (ours only; vLLM reports no per-request counts)
    and end-to-end latency p50 (ms)."""
    tasks = sorted({t for r in runs for t in r.get("by_task", {})})
    if not tasks:
        return []
    lines = ["## Per Spec-Bench task: mean acceptance length / latency p50 (ms)", "",
             "| run | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for run in runs:
        cells = [f"{_fmt(t.get('mean_acceptance_length'), 2)} / {_fmt(t.get('latency_ms_p50'), 0)}"
                 for t in (run.get("by_task", {}).get(task, {}) for task in tasks)]
        lines.append(f"| {run['run_id']} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot(runs: list[dict], out_dir: str, title_suffix: str) -> list[str]:
    """PNG plots into ``out_dir``: throughput, latency and step-time split. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    labels = [f"{_label(r)}\nT={r['temperature']} m={r['m']}" for r in runs]
    for name, keys, ylabel in (("throughput.png", ("output_tokens_per_s",), "output tokens/s"),
                               ("latency.png", ("latency_ms_p50", "latency_ms_p99"), "end-to-end latency (ms)"),
                               ("ttft.png", ("ttft_ms_p50", "ttft_ms_p99"), "TTFT (ms)")):
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(runs)), 4))
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            ax.bar([x + i * width for x in range(len(runs))], [r["metrics"][key] for r in runs], width, label=key)
        ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(runs))], labels, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} {title_suffix}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(f"{out_dir}/{name}")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    paths += _plot_k_sweep(plt, runs, out_dir, title_suffix)
    split_runs = [r for r in runs if r.get("step_split")]
    if split_runs:
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(split_runs)), 4))
        width = 0.2
        for i, key in enumerate(("draft_ms", "verify_ms", "data_plane_ms", "idle_ms")):
            ax.bar([x + i * width for x in range(len(split_runs))], [r["step_split"][key] for r in split_runs],
                   width, label=key)
        ax.set_xticks([x + 1.5 * width for x in range(len(split_runs))],
                      [f"{_label(r)}\nT={r['temperature']} m={r['m']}" for r in split_runs], fontsize=7)
        ax.set_ylabel("mean ms per coordinator step")
        ax.set_title(f"step-time split (psd: draft overlaps verify) {title_suffix}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(f"{out_dir}/step_split.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _plot_k_sweep(plt, runs: list[dict], out_dir: str, title_suffix: str) -> list[str]:
    """``k_sweep.png``: output tokens/s over k for every system run at two or more k values."""
    series: dict[tuple, list[tuple[int, float]]] = {}
    for run in runs:
        if run["k"] is not None:
            series.setdefault((run["system"], run["temperature"], run["m"]), []).append(
                (run["k"], run["metrics"]["output_tokens_per_s"]))
    series = {key: sorted(points) for key, points in series.items() if len(points) >= 2}
    if not series:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for (system, temperature, m), points in series.items():
        ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=f"{system} T={temperature} m={m}")
    ax.set_xlabel("k (num_speculative_tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"k sweep {title_suffix}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = f"{out_dir}/k_sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
