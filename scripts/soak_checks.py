"""The soak's verdicts (``scripts/soak.py``): classify outcomes, compare greedy outputs, goals.

Classes of a request (``classify``): ``completed``, ``aborted`` (asked for by the workload),
``hung`` (its stream did not end within the deadline), ``killed_in_flight`` (failed and was
running when the coordinator was SIGKILLed: started before the kill, ended after it),
``unavailable_while_down`` (UNAVAILABLE, sent while the killed coordinator was down, up to
``DOWN_SLACK_S`` after it was SERVING again) and ``failed`` (every other failure). A drafter kill
excuses nothing: the coordinator must go on in ``ar`` without failing a request.

Greedy check (``check_greedy``): every choice of a completed greedy request against the ``ar``
reference of its prompt and penalties (``max_tokens`` = the workload's maximum, no stop strings):
equal to the reference cut at its ``max_tokens``, or, with stop strings, a prefix of it.
Goals (``goals``): 0 failed, 0 hung, 0 KV slots in use after the drain, every compared greedy
output equal, and every kill followed by a restart.
"""
from __future__ import annotations

import collections
import statistics

from soak_workload import greedy_key, is_greedy

DOWN_SLACK_S = 2.0


def classify(result: dict, kills: list[dict]) -> str:
    """The class of one result (see the module docstring); ``kills``: {service, killed_at, serving_at}."""
    if result["outcome"] != "failed":
        return result["outcome"]
    for kill in kills:
        if kill["service"] != "coordinator":
            continue
        if result["start"] <= kill["killed_at"] <= result["end"]:
            return "killed_in_flight"
        serving_at = kill.get("serving_at", float("inf"))
        if result.get("code") == "UNAVAILABLE" and kill["killed_at"] <= result["start"] <= serving_at + DOWN_SLACK_S:
            return "unavailable_while_down"
    return "failed"


def check_greedy(result: dict, reference: dict[str, list[int]]) -> list[str]:
    """Mismatches of a completed greedy result against the reference (one line each; empty = equal)."""
    plan = result["plan"]
    ref = reference.get(greedy_key(plan))
    if ref is None:
        return [f"{result['request_id']}: no reference for {greedy_key(plan)!r}"]
    max_tokens, has_stop = plan["sampling"]["max_tokens"], bool(plan["sampling"].get("stop"))
    mismatches = []
    for index, choice in enumerate(result["choices"]):
        ids = choice["token_ids"]
        expected = ref[:len(ids)] if has_stop else ref[:max_tokens]
        if ids != expected:
            first = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
            mismatches.append(f"{result['request_id']}#{index}: differs from ar at token {first} "
                              f"(got {ids[first:first + 4]}, ar {expected[first:first + 4]}, "
                              f"{len(ids)} vs {len(expected)} tokens, finish {choice['finish_reason']})")
    return mismatches


def slots_leaked(slots: dict[str, int]) -> int:
    return sum(slots.values())


def percentile_ms(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1e3, 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3, 1)


def summarize(results: list[dict], kills: list[dict], reference: dict[str, list[int]], slots: dict[str, int],
              wall_s: float, t0: float = 0.0) -> dict:
    """The figures of one run (without args / stack details); see ``goals``."""
    classes = [classify(r, kills) for r in results]
    counts = collections.Counter(classes)
    completed = [r for r, c in zip(results, classes) if c == "completed"]
    greedy = [r for r in completed if is_greedy(r["plan"])]
    mismatches = [m for r in greedy for m in check_greedy(r, reference)]
    by_class = lambda name: [r for r, c in zip(results, classes) if c == name]  # noqa: E731
    codes = lambda name: dict(collections.Counter(r.get("code", "") for r in by_class(name)))  # noqa: E731
    sample = lambda name: [{k: r.get(k) for k in ("request_id", "code", "message")} for r in by_class(name)[:10]]  # noqa: E731
    latencies = [r["latency_s"] for r in completed]
    ttfts = [r["ttft_s"] for r in completed if r.get("ttft_s") is not None]
    return {
        "wall_s": round(wall_s, 1), "num_requests": len(results),
        **{name: counts[name] for name in ("completed", "aborted", "failed", "killed_in_flight",
                                           "unavailable_while_down", "hung")},
        "by_kind": dict(collections.Counter(r["plan"]["kind"] for r in results)),
        "completed_by_kind": dict(collections.Counter(r["plan"]["kind"] for r in completed)),
        "retried_requests": sum(r.get("retries", 0) > 0 for r in results),
        "retries": sum(r.get("retries", 0) for r in results),
        "failed_by_code": codes("failed"), "killed_in_flight_by_code": codes("killed_in_flight"),
        "finish_reasons": dict(collections.Counter(c["finish_reason"] for r in completed for c in r["choices"])),
        "completion_tokens": sum(c["completion_tokens"] for r in completed for c in r["choices"]),
        "greedy_compared": sum(len(r["choices"]) for r in greedy), "greedy_equal": sum(len(r["choices"]) for r in greedy)
        - len(mismatches), "greedy_mismatches": mismatches[:20], "num_reference_keys": len(reference),
        "slots_in_use_after_drain": slots, "leaked_slots": slots_leaked(slots),
        "latency_ms": {"p50": percentile_ms(latencies, 50), "p99": percentile_ms(latencies, 99)},
        "ttft_ms": {"p50": percentile_ms(ttfts, 50), "p99": percentile_ms(ttfts, 99)},
        "kills": [{**k, "killed_s": round(k["killed_at"] - t0, 3),
                   "serving_s": None if k.get("serving_at") is None else round(k["serving_at"] - t0, 3)} for k in kills],
        "requests": [request_record(r, c, t0) for r, c in zip(results, classes)],
        "failures": sample("failed"), "killed_in_flight_sample": sample("killed_in_flight"),
        "unavailable_while_down_sample": sample("unavailable_while_down"), "hung_sample": sample("hung"),
    }


def request_record(result: dict, cls: str, t0: float) -> dict:
    """One request in the JSON: id, kind, class, code, start and end (s after ``t0``), retries."""
    return {"id": result["request_id"], "kind": result["plan"]["kind"], "class": cls, "code": result.get("code"),
            "start_s": round(result["start"] - t0, 3), "end_s": round(result["end"] - t0, 3),
            "retries": result.get("retries", 0)}


def goals(summary: dict, expected_kills: tuple[str, ...]) -> dict[str, bool]:
    """Each goal of the reliability figure, met or not."""
    killed = [k["service"] for k in summary["kills"] if k.get("serving_at") is not None]
    return {"no_failed": summary["failed"] == 0, "no_hung_streams": summary["hung"] == 0,
            "no_leaked_slots": summary["leaked_slots"] == 0,
            "greedy_equal_ar": summary["greedy_compared"] > 0 and summary["greedy_equal"] == summary["greedy_compared"],
            "kills_restarted": sorted(killed) == sorted(expected_kills)}
