"""``minedraft timeline``: draw recorded coordinator steps like the MineDraft paper's Figure 2 (right).

Input, either:
- the coordinator's step log (``--step-log PATH``, JSON lines; ``coordinator.tracing.StepLog``);
- an OTLP JSON export of traces (one ``ExportTraceServiceRequest`` JSON object per line or one
  per file, e.g. the OpenTelemetry Collector's ``file`` exporter): the ``coordinator.step``
  spans with their ``phase`` events.

Output: a PNG with a drafter row and a verifier row over wall-clock time. Each engine call is a
box of its reported compute time starting when the coordinator sent the RPC, coloured by PSD
batch (0 / 1); gaps are idle time. Dotted lines mark step starts. The title gives the mode, k and
the parallel-step ratio (steps where one batch was drafted while the other was verified, over
all steps of the input; paper Table 2).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ENGINE_ROWS = ("verifier", "drafter")  # bottom to top
BATCH_COLOURS = ("tab:blue", "tab:orange")
DEFAULT_MAX_STEPS = 30


@dataclass(frozen=True)
class StepRecord:
    """One coordinator step: its fields and phases (engine, batch, start_s, compute_ms, ...)."""

    step_id: int
    mode: str
    k: int
    start_s: float
    wall_ms: float
    is_parallel: bool
    phases: tuple[dict, ...]


def load_steps(path: str) -> list[StepRecord]:
    """Read a step log or OTLP JSON export (detected per file). Raises ValueError if it holds no step."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    objects = _json_objects(text)
    steps = []
    for obj in objects:
        if "resourceSpans" in obj:
            steps += _steps_from_otlp(obj)
        elif "step_id" in obj:
            steps.append(StepRecord(int(obj["step_id"]), obj["mode"], int(obj["k"]), float(obj["start_s"]),
                                    float(obj["wall_ms"]), bool(obj["is_parallel"]), tuple(obj.get("phases", ()))))
    if not steps:
        raise ValueError(f"{path}: no coordinator steps (expected a --step-log file or an OTLP JSON export)")
    return sorted(steps, key=lambda s: s.step_id)


def _json_objects(text: str) -> list[dict]:
    text = text.strip()
    if not text:
        return []
    try:
        whole = json.loads(text)
        return whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _otlp_value(value: dict):
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    return None


def _attrs(items: list[dict]) -> dict:
    return {item["key"]: _otlp_value(item.get("value", {})) for item in items}


def _steps_from_otlp(request: dict) -> list[StepRecord]:
    steps = []
    for resource_spans in request["resourceSpans"]:
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                if span.get("name") != "coordinator.step":
                    continue
                a = _attrs(span.get("attributes", []))
                phases = tuple({**_attrs(e.get("attributes", [])), "start_s": int(e["timeUnixNano"]) / 1e9}
                               for e in span.get("events", []) if e.get("name") == "phase")
                steps.append(StepRecord(int(a["minedraft.step_id"]), a.get("minedraft.mode", ""),
                                        int(a.get("minedraft.k", 0)), int(span["startTimeUnixNano"]) / 1e9,
                                        float(a.get("minedraft.wall_ms", 0.0)),
                                        bool(a.get("minedraft.is_parallel", False)), phases))
    return steps


def parallel_step_ratio(steps: list[StepRecord]) -> float:
    """Share of steps where both batches were busy (0.0 for no steps)."""
    return sum(s.is_parallel for s in steps) / len(steps) if steps else 0.0


def render(steps: list[StepRecord], out_path: str, first_step: int = 0,
           max_steps: int = DEFAULT_MAX_STEPS) -> float:
    """Draw ``max_steps`` steps from step id ``first_step`` on (0 = the first) into ``out_path`` (PNG).

    Returns the parallel-step ratio over all ``steps``. Raises ValueError if the window is empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    window = [s for s in steps if s.step_id >= first_step][:max_steps]
    if not window:
        raise ValueError(f"first_step: no step with id >= {first_step}")
    t0 = window[0].start_s
    fig, ax = plt.subplots(figsize=(12, 2.8))
    for row, engine in enumerate(ENGINE_ROWS):
        for step in window:
            for p in step.phases:
                if p["engine"] == engine:
                    ax.broken_barh([(p["start_s"] - t0, p["compute_ms"] / 1e3)], (row - 0.35, 0.7),
                                   facecolors=BATCH_COLOURS[int(p["batch"]) % 2], edgecolors="black", linewidth=0.5)
    for step in window:
        ax.axvline(step.start_s - t0, color="grey", linestyle=":", linewidth=0.6)
    ax.set_yticks(range(len(ENGINE_ROWS)), [e.capitalize() for e in ENGINE_ROWS])
    ax.set_xlabel("time (s)")
    ratio = parallel_step_ratio(steps)
    num_parallel = sum(s.is_parallel for s in steps)
    ax.set_title(f"mode {window[0].mode}, k = {window[0].k}: steps {window[0].step_id}-{window[-1].step_id}; "
                 f"parallel-step ratio {ratio:.2f} ({num_parallel}/{len(steps)} steps)")
    ax.legend(handles=[Patch(facecolor=c, edgecolor="black", label=f"batch {i}") for i, c in enumerate(BATCH_COLOURS)],
              loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return ratio


def main(input_path: str, out_path: str, first_step: int = 0, max_steps: int = DEFAULT_MAX_STEPS) -> int:
    """CLI entry: render and print the output path and ratio; returns the exit status."""
    steps = load_steps(input_path)
    ratio = render(steps, out_path, first_step, max_steps)
    print(f"{out_path}: {len(steps)} steps, parallel-step ratio {ratio:.3f}")
    return 0
