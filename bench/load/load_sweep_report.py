"""Results of ``bench/load/load_sweep.py``: per (configuration, load point) metrics, the best fixed
configuration per point, issue 10's goals, greedy identity vs ``ar``; JSON + Markdown + one PNG.

With ``--rounds R`` every (configuration, point) is measured R times (the whole configuration
list once per round, so slow drift of the machine hits every configuration alike). A point's
figures are then those of its median-throughput round, its output tokens/s the median over the
rounds (``rounds_tps`` keeps each round's), and auto/best is also given per round (each round's
auto against the same round's run of the configuration that is best by median), a paired ratio
less exposed to drift between rounds than the ratio of medians.

Goals (issue 10, output tokens/s): ``auto`` within 3% of the best fixed (mode, k, m) at every
closed-loop point (auto/best >= 0.97) and above it on the bursty open-loop trace (> 1.0); psd with
adaptive k at least 1.8x sd at its best point (psd-adaptive's highest-throughput point, against
the best fixed sd configuration at that point).
"""
from __future__ import annotations

import json
import os
import statistics

from bench.load.load_sweep_cli import SweepConfig
from minedraft.prompts import write_json

AUTO_WITHIN = 0.97          # auto/best fixed at every closed-loop point
AUTO_BURST_ABOVE = 1.0      # auto/best fixed on the bursty trace
PSD_ADAPTIVE_OVER_SD = 1.8  # psd-adaptive/best sd at psd-adaptive's best point
TPS = "output_tokens_per_s"
COLUMNS = ((TPS, "output tok/s", 1), ("ttft_ms_p50", "TTFT p50 ms", 0), ("ttft_ms_p99", "TTFT p99 ms", 0),
           ("latency_ms_p50", "latency p50 ms", 0), ("latency_ms_p99", "latency p99 ms", 0),
           ("mean_acceptance_length", "mean acceptance length", 2), ("step_wall_ms_mean", "step ms", 1),
           ("slow_step_s", "steps > 100 ms (s)", 2))


def compare_tokens(results: list, reference: list) -> dict:
    """Requests (matched by index: same prompt) whose output token ids equal the reference's."""
    pairs = list(zip(results, reference))
    differing = [i for i, (ours, ref) in enumerate(pairs) if list(ours.token_ids) != list(ref.token_ids)]
    return {"num_compared": len(pairs), "num_equal": len(pairs) - len(differing), "differing": differing[:8]}


class SweepReport:
    """Collects points and rewrites results.json / results.md / load_sweep.png after each one."""

    def __init__(self, out_dir: str, config: dict, configs: tuple[SweepConfig, ...]) -> None:
        self.out_dir, self.config, self.configs = out_dir, config, {c.name: c for c in configs}
        self.points: dict[str, dict[str, dict]] = {}        # config name -> point label -> summary (median round)
        self.rounds: dict[str, dict[str, list[dict]]] = {}  # config name -> point label -> metrics per round
        self.outputs: dict[str, dict[str, list]] = {}       # config name -> point label -> results per round
        self.notes: list[str] = []

    def add(self, config: SweepConfig, label: str, metrics: dict, results: list) -> None:
        """One round of ``config`` at ``label``: its metrics and per-request results."""
        self.outputs.setdefault(config.name, {}).setdefault(label, []).append(results)
        self.rounds.setdefault(config.name, {}).setdefault(label, []).append(dict(metrics))
        self._check_identity(label)
        for name, by_label in self.rounds.items():
            if label in by_label:
                self.points.setdefault(name, {})[label] = summarize_rounds(by_label[label])
        self.write()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.write()

    def _check_identity(self, label: str) -> None:
        """At temperature 0: every configuration's outputs at ``label`` vs the greedy reference,
        the first ``ar`` configuration that ran ``label``."""
        ref = next((name for name, cfg in self.configs.items()
                    if cfg.mode == "ar" and label in self.outputs.get(name, {})), None)
        if self.config.get("temperature") != 0 or ref is None:
            return
        reference = self.outputs[ref][label]
        for name, by_label in self.outputs.items():
            if name == ref or label not in by_label:
                continue
            for index, results in enumerate(by_label[label]):   # round i against the reference's round i
                run = self.rounds[name][label][index]
                if "outputs_equal_to_ar" not in run:
                    run["outputs_equal_to_ar"] = compare_tokens(results, reference[min(index, len(reference) - 1)])

    def labels(self) -> list[str]:
        seen: list[str] = []
        for by_label in self.points.values():
            seen += [label for label in by_label if label not in seen]
        return seen

    def analysis(self) -> dict:
        """Best fixed per point, auto/best, psd-adaptive/best sd, and the goals met or missed."""
        per_point = {}
        for label in self.labels():
            tps = {name: m[label][TPS] for name, m in self.points.items() if label in m}
            fixed = {n: v for n, v in tps.items() if self.configs[n].is_fixed}
            sd = {n: v for n, v in fixed.items() if self.configs[n].mode == "sd"}
            best = max(fixed, key=fixed.get) if fixed else None
            entry = {"best_fixed": best, "best_fixed_tps": fixed.get(best), "best_sd": max(sd, key=sd.get) if sd else None}
            for name, value in tps.items():
                cfg = self.configs[name]
                if cfg.mode == "auto" and best:
                    entry[f"{name}/best_fixed"] = value / fixed[best]
                    if len(self.rounds[name][label]) > 1:
                        entry[f"{name}/best_fixed per round"] = paired_ratios(self.rounds[name][label],
                                                                              self.rounds[best][label])
                if cfg.mode == "psd" and cfg.k_policy == "adaptive" and sd:
                    entry[f"{name}/best_sd"] = value / max(sd.values())
                    same = f"sd-k{cfg.k}-m{cfg.m}"   # sd with the same k (bound) and m
                    if same in sd:
                        entry[f"{name}/{same}"] = value / sd[same]
            per_point[label] = entry
        return {"per_point": per_point, "goals": self._goals(per_point)}

    def _goals(self, per_point: dict) -> dict:
        goals = {}
        for name, cfg in self.configs.items():
            ratios = {label: e[f"{name}/best_fixed"] for label, e in per_point.items() if f"{name}/best_fixed" in e}
            if cfg.mode == "auto" and ratios:
                closed = {lb: r for lb, r in ratios.items() if self.points[name][lb]["kind"] == "closed"}
                bursty = {lb: r for lb, r in ratios.items() if self.points[name][lb]["kind"] == "open"}
                goals[f"{name}: within 3% of the best fixed at every load point"] = {
                    "met": bool(closed) and min(closed.values()) >= AUTO_WITHIN, "worst": min(closed.values(), default=None)}
                goals[f"{name}: above the best fixed on the bursty trace"] = {
                    "met": bool(bursty) and min(bursty.values()) > AUTO_BURST_ABOVE, "ratio": min(bursty.values(), default=None)}
            if cfg.mode == "psd" and cfg.k_policy == "adaptive" and name in self.points:
                best_label = max(self.points[name], key=lambda lb: self.points[name][lb][TPS])
                ratio = per_point[best_label].get(f"{name}/best_sd")
                goals[f"{name}: >= 1.8x sd at its best point"] = {
                    "met": ratio is not None and ratio >= PSD_ADAPTIVE_OVER_SD, "point": best_label, "ratio": ratio}
        return goals

    def as_json(self) -> dict:
        configs = {name: vars(cfg) | {"is_fixed": cfg.is_fixed} for name, cfg in self.configs.items()}
        return {"config": self.config, "configs": configs, "points": self.points, "rounds": self.rounds,
                "analysis": self.analysis(), "notes": self.notes}

    def write(self) -> None:
        payload = self.as_json()
        write_json(os.path.join(self.out_dir, "results.json"), payload)
        with open(os.path.join(self.out_dir, "results.md"), "w", encoding="utf-8") as f:
            f.write(render_markdown(payload))
        plot(payload, os.path.join(self.out_dir, "load_sweep.png"))


def summarize_rounds(runs: list[dict]) -> dict:
    """A point's summary over its rounds: the median-throughput round's metrics with the median
    output tokens/s (``rounds_tps``: every round's), and identity counts summed over rounds."""
    ranked = sorted(runs, key=lambda m: m[TPS])
    summary = dict(ranked[(len(ranked) - 1) // 2])
    values = [m[TPS] for m in runs]
    summary.update({TPS: statistics.median(values), "rounds_tps": values, "num_rounds": len(runs)})
    checks = [m["outputs_equal_to_ar"] for m in runs if "outputs_equal_to_ar" in m]
    if checks:
        summary["outputs_equal_to_ar"] = {
            "num_compared": sum(c["num_compared"] for c in checks), "num_equal": sum(c["num_equal"] for c in checks),
            "differing": [i for c in checks for i in c["differing"]][:8]}
    return summary


def paired_ratios(runs: list[dict], reference: list[dict]) -> list[float]:
    """Round i's output tokens/s over the reference's round i, for the rounds both ran."""
    return [m[TPS] / ref[TPS] for m, ref in zip(runs, reference) if ref[TPS] > 0]


def _cell(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def _point_rows(payload: dict, label: str) -> list[str]:
    rows = []
    for name, by_label in payload["points"].items():
        m = by_label.get(label)
        if m is None:
            continue
        eq = m.get("outputs_equal_to_ar")
        steps = ", ".join(f"{mode} {n}" for mode, n in m.get("steps_by_mode", {}).items()) or "-"
        ks = ", ".join(f"k{k}: {n}" for k, n in m.get("steps_by_k", {}).items()) or "-"
        cells = [_cell(m.get(key), digits) for key, _, digits in COLUMNS]
        spread = m.get("rounds_tps") or [m[TPS]]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {min(spread):.1f}-{max(spread):.1f} ({len(spread)}) "
                    f"| {steps} | {ks} | "
                    + (f"{eq['num_equal']}/{eq['num_compared']}" if eq else "-") + " |")
    return rows


def render_markdown(payload: dict) -> str:
    """Per point: a table of every configuration; then best fixed, ratios and goals."""
    lines = [f"config: `{json.dumps(payload['config'], sort_keys=True)}`", ""]
    header = ("| configuration | " + " | ".join(t for _, t, _ in COLUMNS)
              + " | tok/s min-max (rounds) | steps by mode | steps by k | outputs = ar |")
    analysis = payload["analysis"]
    for label in analysis["per_point"]:
        lines += [f"### load point {label}", "", header, "|---" * (len(COLUMNS) + 5) + "|", *_point_rows(payload, label), ""]
    lines += ["### best fixed configuration per load point", "",
              "| point | best fixed | tok/s | ratios |", "|---|---|---|---|"]
    for label, e in analysis["per_point"].items():
        ratios = ", ".join(f"{k} = {_ratios(v)}" for k, v in e.items() if "/" in k)
        lines.append(f"| {label} | {e['best_fixed']} | {_cell(e['best_fixed_tps'], 1)} | {ratios or '-'} |")
    lines += ["", "### goals (issue 10)", ""]
    for goal, result in analysis["goals"].items():
        detail = ", ".join(f"{k} {_cell(v, 3) if isinstance(v, float) else v}" for k, v in result.items() if k != "met")
        lines.append(f"- {goal}: **{'met' if result['met'] else 'missed'}** ({detail})")
    lines += [""] + [f"- {note}" for note in payload["notes"]]
    return "\n".join(lines) + "\n"


def _ratios(value) -> str:
    return " / ".join(f"{v:.3f}" for v in value) if isinstance(value, list) else f"{value:.3f}"


def plot(payload: dict, path: str) -> None:
    """Output tok/s against closed-loop concurrency per configuration (left), bursty trace (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    left.set_prop_cycle(color=plt.get_cmap("tab20").colors)   # one colour per configuration (up to 20)
    bursty = {}
    for name, by_label in payload["points"].items():
        closed = sorted((m["concurrency"], m[TPS]) for m in by_label.values() if m["kind"] == "closed")
        style = "-" if payload["configs"][name]["is_fixed"] else "--"
        if closed:
            left.plot(*zip(*closed), style, marker="o", label=name, linewidth=2.5 if style == "--" else 1)
        bursty.update({name: m[TPS] for m in by_label.values() if m["kind"] == "open"})
    left.set(xscale="log", xlabel="concurrency (requests in flight, closed loop)", ylabel="output tokens/s",
             title="load sweep")
    if left.get_legend_handles_labels()[0]:
        left.legend(fontsize=7, ncol=2)
    right.barh(list(bursty), list(bursty.values()))
    right.set(xlabel="output tokens/s", title="bursty open-loop trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
