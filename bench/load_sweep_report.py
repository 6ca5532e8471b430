"""Results of ``bench/load_sweep.py``: per (configuration, load point) metrics, the best fixed
configuration per point, issue 10's goals, greedy identity vs ``ar``; JSON + Markdown + one PNG.

Goals (issue 10, output tokens/s): ``auto`` within 3% of the best fixed (mode, k, m) at every
closed-loop point (auto/best >= 0.97) and above it on the bursty open-loop trace (> 1.0); psd with
adaptive k at least 1.8x sd at its best point (psd-adaptive's highest-throughput point, against
the best fixed sd configuration at that point).
"""
from __future__ import annotations

import json
import os

from bench.load_sweep_cli import SweepConfig
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
        self.points: dict[str, dict[str, dict]] = {}        # config name -> point label -> metrics
        self.outputs: dict[str, dict[str, list]] = {}       # config name -> point label -> results
        self.notes: list[str] = []

    def add(self, config: SweepConfig, label: str, metrics: dict, results: list) -> None:
        self.outputs.setdefault(config.name, {})[label] = results
        self.points.setdefault(config.name, {})[label] = metrics
        self._check_identity(label)
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
        for name, by_label in self.outputs.items():
            if name != ref and label in by_label:
                self.points[name][label]["outputs_equal_to_ar"] = compare_tokens(by_label[label], self.outputs[ref][label])

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
        return {"config": self.config, "configs": configs, "points": self.points, "analysis": self.analysis(),
                "notes": self.notes}

    def write(self) -> None:
        payload = self.as_json()
        write_json(os.path.join(self.out_dir, "results.json"), payload)
        with open(os.path.join(self.out_dir, "results.md"), "w", encoding="utf-8") as f:
            f.write(render_markdown(payload))
        plot(payload, os.path.join(self.out_dir, "load_sweep.png"))


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
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {steps} | {ks} | "
                    + (f"{eq['num_equal']}/{eq['num_compared']}" if eq else "-") + " |")
    return rows


def render_markdown(payload: dict) -> str:
    """Per point: a table of every configuration; then best fixed, ratios and goals."""
    lines = [f"config: `{json.dumps(payload['config'], sort_keys=True)}`", ""]
    header = "| configuration | " + " | ".join(t for _, t, _ in COLUMNS) + " | steps by mode | steps by k | outputs = ar |"
    analysis = payload["analysis"]
    for label in analysis["per_point"]:
        lines += [f"### load point {label}", "", header, "|---" * (len(COLUMNS) + 4) + "|", *_point_rows(payload, label), ""]
    lines += ["### best fixed configuration per load point", "",
              "| point | best fixed | tok/s | ratios |", "|---|---|---|---|"]
    for label, e in analysis["per_point"].items():
        ratios = ", ".join(f"{k} = {v:.3f}" for k, v in e.items() if "/" in k)
        lines.append(f"| {label} | {e['best_fixed']} | {_cell(e['best_fixed_tps'], 1)} | {ratios or '-'} |")
    lines += ["", "### goals (issue 10)", ""]
    for goal, result in analysis["goals"].items():
        detail = ", ".join(f"{k} {_cell(v, 3) if isinstance(v, float) else v}" for k, v in result.items() if k != "met")
        lines.append(f"- {goal}: **{'met' if result['met'] else 'missed'}** ({detail})")
    lines += [""] + [f"- {note}" for note in payload["notes"]]
    return "\n".join(lines) + "\n"


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
