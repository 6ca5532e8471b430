"""Where the wall time of one benchmark run of our stack goes (issue 8: "our ar vs vLLM's ar").

Reads a run's per-request outputs (``bench.common.suite``: ``outputs/<run_id>.json``, Unix start/end
seconds per request) and the coordinator's step log of that system (``--step-log``,
``steps.jsonl``), and splits the run's wall time ``[first request sent, last stream ended]`` into:

- ``verify_ms``: verifier compute inside the logged steps (``verify_ms`` of each step);
- ``step_overhead_ms``: the rest of the logged steps' wall (gRPC, serialization, coordinator
  commit and streaming);
- ``admission_gap_ms``: time between two steps (or before the first one) that is followed by a
  step with requests never seen before: the admission of those requests, i.e. their prefill on
  the verifier (and the KV release of finished requests, which shares the gap);
- ``other_gap_ms``: the other time between steps (release RPCs, an idle loop waiting for
  requests), and the time after the last step until the last stream ended.

Steps of the same system's other runs (warm-up, other temperatures) fall outside the window and
are ignored. Usage::

    python -m bench.cpu.cpu_step_stack --outputs bench/results/suite/NAME/outputs/ar-m4-T0.json \
        --steps runs/bench/NAME/logs/ar-m4/steps.jsonl [--out bench/results/NAME_wall.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MS_PER_S = 1e3


def load_jsonl(path: str) -> list[dict]:
    """The JSON objects of a ``.jsonl`` file, one per non-empty line."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def account(requests: list[dict], steps: list[dict]) -> dict:
    """Split a run's wall time (ms) as the module docstring says.

    Args:
        requests: per-request records with ``start_s``/``end_s`` (Unix s) and
            ``num_output_tokens``.
        steps: step-log records (``start_s`` Unix s; ``wall_ms``, ``verify_ms``, ``request_ids``,
            ``num_verify``, ``num_emitted_tokens``).

    Returns:
        a dict of the parts (ms), counts and per-step means; the parts add up to ``wall_ms``.

    Raises:
        ValueError: no request, or no logged step inside the run's window.
    """
    if not requests:
        raise ValueError("requests: empty")
    start_s = min(r["start_s"] for r in requests)
    end_s = max(r["end_s"] for r in requests)
    steps = sorted((s for s in steps if start_s <= s["start_s"] <= end_s), key=lambda s: s["start_s"])
    if not steps:
        raise ValueError("steps: no logged step inside the run's window")
    parts = {"verify_ms": 0.0, "step_overhead_ms": 0.0, "admission_gap_ms": 0.0, "other_gap_ms": 0.0}
    seen: set[str] = set()
    cursor_s, num_admissions, num_admitted = start_s, 0, 0
    for step in steps:
        gap_ms = max(step["start_s"] - cursor_s, 0.0) * MS_PER_S
        new_ids = set(step.get("request_ids", [])) - seen
        seen |= new_ids
        if new_ids:
            parts["admission_gap_ms"] += gap_ms
            num_admissions += 1
            num_admitted += len(new_ids)
        else:
            parts["other_gap_ms"] += gap_ms
        parts["verify_ms"] += step["verify_ms"]
        parts["step_overhead_ms"] += max(step["wall_ms"] - step["verify_ms"], 0.0)
        cursor_s = step["start_s"] + step["wall_ms"] / MS_PER_S
    parts["other_gap_ms"] += max(end_s - cursor_s, 0.0) * MS_PER_S
    wall_ms = (end_s - start_s) * MS_PER_S
    num_tokens = sum(r["num_output_tokens"] for r in requests)
    return {
        "wall_ms": round(wall_ms, 1), **{k: round(v, 1) for k, v in parts.items()},
        "share": {k: round(v / wall_ms, 3) for k, v in parts.items()},
        "num_requests": len(requests), "num_output_tokens": num_tokens,
        "output_tokens_per_s": round(num_tokens * MS_PER_S / wall_ms, 2),
        "num_steps": len(steps), "num_admission_gaps": num_admissions, "num_admitted": num_admitted,
        "mean_rows_per_step": round(sum(s["num_verify"] for s in steps) / len(steps), 2),
        "mean_step_wall_ms": round(sum(s["wall_ms"] for s in steps) / len(steps), 1),
        "mean_verify_ms": round(parts["verify_ms"] / len(steps), 1),
        "mean_admission_gap_ms": round(parts["admission_gap_ms"] / max(num_admissions, 1), 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", required=True, help="bench.common.suite outputs/<run_id>.json")
    parser.add_argument("--steps", required=True, help="the system's coordinator steps.jsonl")
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    with open(args.outputs, encoding="utf-8") as f:
        requests = json.load(f)
    result = {"outputs": args.outputs, "steps": args.steps, **account(requests, load_jsonl(args.steps))}
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
