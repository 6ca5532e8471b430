"""Results of bench/gpu/gpu_stack.py: per-run metrics, greedy output checks, ratios, JSON + Markdown.

Ratios (output tokens/s): psd/sd, psd/ar and psd/(2x sd) (two data-parallel sd replicas, one
per GPU, the same hardware as psd), for the real models (parts a, b) and the paper-scale random
models (parts c, d). Parts c and d ran with the BENCHMARK-ONLY fixed acceptance: every table,
heading and JSON record of theirs carries ``specdec.sample.bench_only.fixed_acceptance_label``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from specdec.sample.bench_only import expected_mean_acceptance_length, fixed_acceptance_label
from minedraft.prompts import summarize, write_json

PAIRS = (("a", "b"), ("c", "d"))          # (modes part, replicas part) on the same models
PAPER_PARTS = ("c", "d")
COLUMNS = (("output_tokens_per_s", "output tok/s"), ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"),
           ("latency_ms_p50", "latency p50 ms"), ("latency_ms_p99", "latency p99 ms"),
           ("mean_acceptance_length", "mean acceptance length"), ("step_wall_ms_mean", "step ms"),
           ("step_draft_ms_mean", "draft ms/step"), ("step_verify_ms_mean", "verify ms/step"))
TITLES = {"a": "{target} target + {draft} draft, verifier {gpu0}, drafter {gpu1}",
          "b": "standard SD on the same hardware: 2 sd replicas, one per {gpu} (draft + target on each), "
               "prompts split between them",
          "c": "paper scale: {paper_target} target + {paper_draft} draft (random weights), verifier {gpu0}, "
               "drafter {gpu1}",
          "d": "paper scale: 2 sd replicas of {paper_target} + {paper_draft} (random weights), one per {gpu}"}


def title(part: str, config: dict) -> str:
    """The heading of a part, naming its models and where they ran."""
    is_cuda = config.get("device") == "cuda"
    places = dict(gpu0="GPU 0" if is_cuda else "cpu", gpu1=f"GPU {config.get('drafter_gpu', 1)}" if is_cuda else "cpu",
                  gpu="GPU" if is_cuda else "engine pair")
    return TITLES[part].format(**places, **{key: config.get(key) for key in
                                            ("target", "draft", "paper_target", "paper_draft")})


@dataclass
class RunResult:
    """One run: mode label, ``summarize`` metrics, and the per-request ``GenerationResult``s."""

    mode: str
    metrics: dict
    results: list = field(default_factory=list)


def merge_runs(mode: str, result_lists: list[list], wall_s: float) -> RunResult:
    """Replicas run at once: metrics over all their requests, throughput over the common wall time."""
    results = [r for results in result_lists for r in results]
    return RunResult(mode, summarize(results, wall_s), results)


STEP_FIELDS = ("wall_ms", "draft_ms", "verify_ms", "data_plane_ms", "idle_ms")


def summarize_step_log(path: str) -> dict:
    """Mean per-step times (ms) of a coordinator ``--step-log`` JSONL (``coordinator.stats.StepStats``
    fields: step wall time, drafter and verifier compute, data plane, verifier idle) and the
    number of steps; ``{}`` when the file is missing or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            steps = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return {}
    if not steps:
        return {}
    means = {f"step_{key}_mean": sum(float(s.get(key, 0.0)) for s in steps) / len(steps) for key in STEP_FIELDS}
    return {"num_steps": len(steps), **means}


def _by_question(results: list) -> dict[str, list[int]]:
    """token ids per question id (request ids are ``q<question_id>-<index>``)."""
    return {r.request_id.rsplit("-", 1)[0]: list(r.token_ids) for r in results}


def compare_outputs(results: list, reference: list) -> dict:
    """How many outputs equal the reference run's, matched by question id."""
    ours, ref = _by_question(results), _by_question(reference)
    common = sorted(set(ours) & set(ref))
    differing = [q for q in common if ours[q] != ref[q]]
    return {"num_compared": len(common), "num_equal": len(common) - len(differing), "differing": differing[:8]}


class Report:
    """Collects runs and rewrites ``results.json`` / ``results.md`` after each one."""

    def __init__(self, out_dir: str, config: dict) -> None:
        self.out_dir = out_dir
        self.config = config
        self.parts: dict[str, dict[str, RunResult]] = {}
        self.notes: dict[str, list[str]] = {}

    def label(self, part: str) -> str:
        p = self.config.get("fixed_acceptance")
        return fixed_acceptance_label(p) if part in PAPER_PARTS and p is not None else ""

    def add(self, part: str, run: RunResult) -> None:
        self.parts.setdefault(part, {})[run.mode] = run
        self.write()

    def skip(self, part: str, what: str, why: str) -> None:
        self.note(part, f"SKIPPED {what}: {why}")

    def note(self, part: str, text: str) -> None:
        self.notes.setdefault(part, []).append(text)
        self.write()

    def summary_line(self, part: str, mode: str) -> str:
        m = self.parts[part][mode].metrics
        label = f"  [{self.label(part)}]" if self.label(part) else ""
        return (f"part {part} {mode}: {m['output_tokens_per_s']:.1f} tok/s, TTFT p50 {m['ttft_ms_p50']:.0f} ms, "
                f"latency p50 {m['latency_ms_p50']:.0f} ms, mean acceptance length "
                f"{m['mean_acceptance_length']:.2f}{label}")

    def _equality(self, part: str) -> dict:
        """Greedy runs of the real models: outputs of every run vs part a's ar."""
        ar = self.parts.get("a", {}).get("ar")
        if part in PAPER_PARTS or ar is None or self.config.get("temperature") != 0:
            return {}
        return {mode: compare_outputs(run.results, ar.results) for mode, run in self.parts.get(part, {}).items()
                if not (part == "a" and mode == "ar")}

    def _ratios(self) -> dict:
        out = {}
        for modes_part, replicas_part in PAIRS:
            tps = {mode: run.metrics["output_tokens_per_s"] for mode, run in self.parts.get(modes_part, {}).items()}
            tps.update({mode: run.metrics["output_tokens_per_s"]
                        for mode, run in self.parts.get(replicas_part, {}).items()})
            ratios = {f"psd/{base}": tps["psd"] / tps[base] for base in ("ar", "sd", "2x sd")
                      if "psd" in tps and tps.get(base)}
            if ratios:
                out[modes_part] = ratios
        return out

    def as_json(self) -> dict:
        parts = {}
        for part, runs in self.parts.items():
            parts[part] = {"title": title(part, self.config), "benchmark_only": self.label(part) or None,
                           "runs": {mode: run.metrics for mode, run in runs.items()},
                           "outputs_equal_to_ar": self._equality(part), "notes": self.notes.get(part, [])}
        p, k = self.config.get("fixed_acceptance"), self.config.get("k")
        has_paper = any(part in self.parts for part in PAPER_PARTS)
        expected = expected_mean_acceptance_length(p, k) if p is not None and has_paper else None
        return {"config": self.config, "parts": parts, "ratios": self._ratios(),
                "notes": {part: notes for part, notes in self.notes.items() if part not in self.parts},
                "paper_scale_expected_mean_acceptance_length": expected}

    def write(self) -> None:
        payload = self.as_json()
        write_json(os.path.join(self.out_dir, "results.json"), payload)
        with open(os.path.join(self.out_dir, "results.md"), "w", encoding="utf-8") as f:
            f.write(render_markdown(payload))


def render_markdown(payload: dict) -> str:
    """Markdown tables of ``Report.as_json()`` (one per part), ratios and notes."""
    lines = [f"config: `{json.dumps(payload['config'], sort_keys=True)}`", ""]
    for part, data in payload["parts"].items():
        label = f" -- **{data['benchmark_only']}**" if data["benchmark_only"] else ""
        lines += [f"### part {part}: {data['title']}{label}", "",
                  "| mode | " + " | ".join(title for _, title in COLUMNS) + " | outputs = ar |",
                  "|---" * (len(COLUMNS) + 2) + "|"]
        for mode, m in data["runs"].items():
            eq = data["outputs_equal_to_ar"].get(mode)
            eq_text = f"{eq['num_equal']}/{eq['num_compared']}" if eq else "-"
            cells = [f"{m[key]:.2f}" if isinstance(m.get(key), (int, float)) else "-" for key, _ in COLUMNS]
            lines.append(f"| {mode} | " + " | ".join(cells) + f" | {eq_text} |")
        lines += [""] + [f"- {note}" for note in data["notes"]] + [""]
    for part, ratios in payload["ratios"].items():
        label = " (BENCHMARK-ONLY fixed acceptance, random weights)" if part in PAPER_PARTS else ""
        lines.append(f"ratios part {part}{label}: " + ", ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))
    if payload.get("paper_scale_expected_mean_acceptance_length") is not None:
        lines.append(f"\nparts c/d: expected mean acceptance length at the fixed acceptance: "
                     f"{payload['paper_scale_expected_mean_acceptance_length']:.2f}")
    for part, notes in payload["notes"].items():
        lines += [f"- part {part}: {note}" for note in notes]
    return "\n".join(lines) + "\n"
