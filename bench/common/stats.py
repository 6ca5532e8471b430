"""Figures of the benchmark suite: per-run summaries, step-time split and ratios (issue 8).

Definitions (the same for every system; MineDraft paper §6 and vLLM's benchmark_serving):
- ``output_tokens_per_s``: completion tokens of all successful requests / wall time of the run;
- ``requests_per_s``: successful requests / wall time;
- ``ttft_ms_p50/p99``, ``latency_ms_p50/p99``: percentiles (linear interpolation) in ms;
- ``tpot_ms_p50/p99``: per request ``(latency - TTFT) / (output tokens - 1)`` (time per output
  token after the first, vLLM's TPOT), percentiles over requests of 2+ tokens, ms;
- ``itl_ms_p50/p99``, ``itl_ms_max``: over every gap between two streamed text chunks of a request
  (inter-token latency, vLLM's ITL), ms;
- ``mean_acceptance_length``: ``1 + accepted / num_drafts`` (tokens committed per verify step that
  carried drafts; 1.0 without speculation, vLLM's definition);
- ``output_tokens_per_s_per_core``: ``output_tokens_per_s / num_cores`` (cores the system's engines own).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

NAN = float("nan")
STEP_SPLIT_KEYS = ("draft_ms", "verify_ms", "data_plane_ms", "idle_ms", "wall_ms")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values.

    Raises:
        ValueError: q outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    finite = sorted(v for v in values if not math.isnan(v))
    if not finite:
        return NAN
    rank = (len(finite) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(finite) - 1)
    return finite[low] + (finite[high] - finite[low]) * (rank - low)


def mean_acceptance_length(num_accepted_tokens: float, num_drafts: float) -> float:
    """``1 + accepted / num_drafts``; 1.0 when nothing was drafted (no speculation)."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts > 0 else 1.0


@dataclass(frozen=True)
class SpecCounts:
    """Speculation counters summed over a run (draft tokens, accepted tokens, verify steps with drafts)."""

    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    num_drafts: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else NAN

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)


def spec_counts_from_usage(results) -> SpecCounts | None:
    """Sum our gateway's ``usage.minedraft`` extension over ``results`` (None when no result has it)."""
    specs = [r.spec for r in results if r.is_ok and r.spec]
    if not specs:
        return None
    return SpecCounts(sum(s.get("num_draft_tokens", 0) for s in specs),
                      sum(s.get("num_accepted_tokens", 0) for s in specs), sum(s.get("num_drafts", 0) for s in specs))


def summarize(results, wall_s: float, num_cores: int, spec: SpecCounts | None) -> dict:
    """The figures of one run (see the module docstring). ``results``: ``bench.common.loadgen.RequestResult``.

    Raises:
        ValueError: ``wall_s`` <= 0 or ``num_cores`` < 1.
    """
    if wall_s <= 0 or num_cores < 1:
        raise ValueError(f"wall_s/num_cores: must be > 0 / >= 1, got {wall_s}/{num_cores}")
    ok = [r for r in results if r.is_ok]
    num_tokens = sum(r.num_output_tokens for r in ok)
    tokens_per_s = num_tokens / wall_s
    spec = spec or SpecCounts()
    tpots = [(r.latency_ms - r.ttft_ms) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl_ms]
    return {
        "num_requests": len(results), "num_errors": len(results) - len(ok), "num_output_tokens": num_tokens,
        "wall_s": wall_s, "output_tokens_per_s": tokens_per_s, "requests_per_s": len(ok) / wall_s,
        "ttft_ms_p50": percentile([r.ttft_ms for r in ok], 50), "ttft_ms_p99": percentile([r.ttft_ms for r in ok], 99),
        "latency_ms_p50": percentile([r.latency_ms for r in ok], 50),
        "latency_ms_p99": percentile([r.latency_ms for r in ok], 99),
        "tpot_ms_p50": percentile(tpots, 50), "tpot_ms_p99": percentile(tpots, 99),
        "itl_ms_p50": percentile(itls, 50), "itl_ms_p99": percentile(itls, 99), "itl_ms_max": max(itls, default=NAN),
        "mean_acceptance_length": spec.mean_acceptance_length, "acceptance_rate": spec.acceptance_rate,
        "num_cores": num_cores, "output_tokens_per_s_per_core": tokens_per_s / num_cores,
    }


def summarize_by_task(results) -> dict[str, dict]:
    """Per Spec-Bench task: requests, output tokens, latency p50 (ms) and, for our systems, the
    mean acceptance length from the usage extension (NaN when not reported)."""
    tasks: dict[str, list] = {}
    for r in results:
        if r.is_ok:
            tasks.setdefault(r.task, []).append(r)
    out = {}
    for task, rows in tasks.items():
        spec = spec_counts_from_usage(rows)
        out[task] = {"num_requests": len(rows), "num_output_tokens": sum(r.num_output_tokens for r in rows),
                     "latency_ms_p50": percentile([r.latency_ms for r in rows], 50),
                     "mean_acceptance_length": spec.mean_acceptance_length if spec else NAN}
    return out


def step_split(step_log_path: str, start_s: float, end_s: float) -> dict | None:
    """Mean per-step time split (ms) from our coordinator's step log (``--step-log``), over the
    steps that started within ``[start_s, end_s]`` (Unix s): draft (drafter compute, summed over
    both PSD batches), verify (verifier compute), data plane (draft-probs transfer), idle
    (verifier idle = wall - verify) and wall; plus ``num_steps`` and ``parallel_step_ratio``.
    None when the file is missing or holds no step in the window."""
    try:
        with open(step_log_path, encoding="utf-8") as f:
            steps = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return None
    steps = [s for s in steps if start_s <= s["start_s"] <= end_s]
    if not steps:
        return None
    split = {key: sum(float(s[key]) for s in steps) / len(steps) for key in STEP_SPLIT_KEYS}
    split["num_steps"] = len(steps)
    split["parallel_step_ratio"] = sum(bool(s["is_parallel"]) for s in steps) / len(steps)
    split.update(critical_call_overhead([s for s in steps if s["is_parallel"]]))
    split.update(critical_call_overhead([s for s in steps if not s["is_parallel"]], prefix="serial"))
    return split


def critical_call_overhead(steps: list[dict], prefix: str = "critical") -> dict:
    """Means over ``steps`` (step-log records with ``phases``) of what surrounds each step's
    critical call, the engine call that ended last: ``<prefix>_lead_ms`` (step start to that call
    being sent: the coordinator's work before it), ``<prefix>_rpc_extra_ms`` (its RPC wall time
    beyond the engine's compute: gRPC and the service) and ``<prefix>_tail_ms`` (its return to the
    step's end: the coordinator's work after it). When every such call's service reported its
    own wall time (``service_ms`` > 0), ``rpc_extra`` splits into ``<prefix>_service_extra_ms``
    (the service's time beyond the engine's compute: validation, thread hops, data plane) and
    ``<prefix>_transport_ms`` (the rest: gRPC both ways and the coordinator's client); when the
    phases also have the RPC's send time and the handler's start (``sent_s``,
    ``service_start_s``: one host, one clock), the transport splits into
    ``<prefix>_request_transport_ms`` (send to the handler's start) and
    ``<prefix>_response_transport_ms`` (the handler's end to the coordinator's receipt). When
    a vLLM verifier reported its engine-core time (``core_steps`` > 0), the call's compute per
    engine step splits into ``<prefix>_core_per_step_ms`` (vLLM's engine core) and
    ``<prefix>_worker_per_step_ms`` (the worker's own work around it).
    ``step_split`` reports them as ``critical_*`` over psd's parallel steps and ``serial_*`` over
    the others (e.g. ``ar``'s, one Verify call each). Empty when no step has phases."""
    rows = [_call_parts(step) for step in steps if step.get("phases")]
    if not rows:
        return {}
    shared = [key for key in rows[0] if all(key in row for row in rows)]   # parts every call reported
    return {f"{prefix}_{key}_ms": sum(row[key] for row in rows) / len(rows) for key in shared}


def _call_parts(step: dict) -> dict:
    """``critical_call_overhead``'s parts (ms) of one step's last-ending call, the service and
    transport splits only where its phase has what they need."""
    last = max(step["phases"], key=lambda p: p["start_s"] + p["rpc_ms"] / 1e3)
    lead_ms = (last["start_s"] - step["start_s"]) * 1e3
    parts = {"lead": lead_ms, "rpc_extra": last["rpc_ms"] - last["compute_ms"],
             "tail": step["wall_ms"] - lead_ms - last["rpc_ms"]}
    service_ms = float(last.get("service_ms") or 0.0)
    if service_ms > 0:
        parts.update(service_extra=service_ms - last["compute_ms"], transport=last["rpc_ms"] - service_ms)
        sent_s, service_start_s = float(last.get("sent_s") or 0.0), float(last.get("service_start_s") or 0.0)
        if sent_s > 0 and service_start_s > 0:
            request_ms = (service_start_s - sent_s) * 1e3
            parts.update(request_transport=request_ms, response_transport=parts["transport"] - request_ms)
    core_steps = int(last.get("core_steps") or 0)
    if core_steps > 0:
        core_ms = float(last["core_ms"])
        parts.update(core_per_step=core_ms / core_steps, worker_per_step=(last["compute_ms"] - core_ms) / core_steps)
    return parts


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN when either is NaN or the denominator is 0."""
    if denominator == 0 or math.isnan(numerator) or math.isnan(denominator):
        return NAN
    return numerator / denominator
