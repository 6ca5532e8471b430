"""Ratios, greedy checks and the Markdown table of ``bench.engines.engines_compare`` results."""
from __future__ import annotations

import math

from bench.engines.compare_systems import parse_system

REFERENCE = "vllm-ar"


def _tok_s(record: dict) -> float:
    return record["metrics"]["output_tokens_per_s"] if "metrics" in record else math.nan


def ratios_by_concurrency(records: list[dict]) -> list[dict]:
    """Per concurrency: each of ours' tok/s over ``vllm-ar``'s and over the best vLLM system's,
    the best of ours over the best vLLM, and ``psd-*`` over the best ``vllm-sd-*``."""
    out = []
    for c in sorted({r["concurrency"] for r in records if "metrics" in r}):
        at = {r["system"]: _tok_s(r) for r in records if r["concurrency"] == c and "metrics" in r}
        vllm = {n: v for n, v in at.items() if parse_system(n).family == "vllm"}
        ours = {n: v for n, v in at.items() if parse_system(n).family == "ours"}
        if not vllm or not ours:
            continue
        best_vllm = max(vllm, key=vllm.get)
        best_ours = max(ours, key=ours.get)
        sds = {n: v for n, v in vllm.items() if n.startswith("vllm-sd")}
        row = {"concurrency": c, "best_vllm": best_vllm, "best_ours": best_ours,
               "best_ours_over_best_vllm": ours[best_ours] / vllm[best_vllm],
               "over_vllm_ar": {n: v / vllm[REFERENCE] for n, v in ours.items()} if REFERENCE in vllm else {},
               "over_best_vllm": {n: v / vllm[best_vllm] for n, v in ours.items()}}
        if sds:
            best_sd = max(sds, key=sds.get)
            row["best_vllm_sd"] = best_sd
            row["psd_over_best_vllm_sd"] = {n: v / sds[best_sd] for n, v in ours.items() if n.startswith("psd")}
        out.append(row)
    return out


def greedy_vs_reference(records: list[dict]) -> list[dict]:
    """For each run: outputs equal to ``vllm-ar``'s at the same concurrency, prompt by prompt."""
    refs = {r["concurrency"]: r.get("outputs", {}) for r in records if r["system"] == REFERENCE}
    out = []
    for r in records:
        ref = refs.get(r["concurrency"])
        if r["system"] == REFERENCE or ref is None or "outputs" not in r:
            continue
        common = sorted(set(ref) & set(r["outputs"]))
        equal = sum(ref[p] == r["outputs"][p] for p in common)
        repeats = sum(repeats_a_stretch(ref[p], r["outputs"][p]) for p in common)
        out.append({"system": r["system"], "concurrency": r["concurrency"], "num_equal": equal,
                    "num_compared": len(common), "num_repeats": repeats})
    return out


def repeats_a_stretch(reference: str, text: str, max_len: int = 200, context: int = 20) -> bool:
    """Whether ``text`` leaves ``reference`` by repeating the stretch just before the divergence
    and then goes on as ``reference`` does: tokens streamed twice, a serving bug's signature (a
    numerics difference substitutes a token instead). A stretch the reference itself had just
    repeated does not count: a model caught in a loop may leave it one round later under other
    numerics ("A and B. A and B. A and B." then on), which no serving bug is needed for; nor
    does a single digit, which a substituted token explains as well ("210 * 10 = 210 photos"
    against "... = 2100 photos"; two digits or more again, "= 8484", still count)."""
    i = next((j for j, (a, b) in enumerate(zip(reference, text)) if a != b), None)
    if i is None:
        return False
    after = reference[i:i + context]
    return any(text[i:i + n] == reference[i - n:i] and text[i + n:i + n + len(after)] == after
               and reference[i - 2 * n:i - n] != reference[i - n:i] and not (n == 1 and reference[i - 1].isdigit())
               for n in range(1, min(max_len, i) + 1))


def _repeat_note(check: dict) -> str:
    n = check.get("num_repeats", 0)
    return f" (**{n} repeat a stretch of text**: a serving bug, not numerics)" if n else ""


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def around_the_call(split: dict) -> float | None:
    """Mean ms per step of the coordinator and gRPC around the step's last-ending engine call
    (``bench.common.stats.critical_call_overhead``: lead + RPC beyond compute + tail), over psd's
    parallel steps when the run had any, else over its other steps; None without them."""
    for prefix in ("critical", "serial"):
        parts = [split.get(f"{prefix}_{name}_ms") for name in ("lead", "rpc_extra", "tail")]
        if all(p is not None for p in parts):
            return sum(parts)
    return None


def rpc_extra_split(split: dict) -> str:
    """``service / transport`` ms of the RPC beyond compute in ``around_the_call`` (the engine
    service's own time, then gRPC and the coordinator's client), same steps, and the transport's
    ``(request + response)`` parts where the phases have them; "-" when the services did not
    report their time (``service_ms``)."""
    for prefix in ("critical", "serial"):
        if f"{prefix}_rpc_extra_ms" in split:
            parts = [split.get(f"{prefix}_{name}_ms") for name in ("service_extra", "transport")]
            if None in parts:
                return "-"
            ways = [split.get(f"{prefix}_{name}_transport_ms") for name in ("request", "response")]
            return f"{parts[0]:.2f} / {parts[1]:.2f}" + ("" if None in ways else f" ({ways[0]:.2f} + {ways[1]:.2f})")
    return "-"


def per_engine_step(split: dict) -> str:
    """``core + worker`` ms per engine step of the verifier's calls (vLLM's engine core, then the
    worker's own work around it), same steps as ``around_the_call``; "-" where not reported."""
    for prefix in ("critical", "serial"):
        parts = [split.get(f"{prefix}_{name}_per_step_ms") for name in ("core", "worker")]
        if None not in parts:
            return f"{parts[0]:.2f} + {parts[1]:.2f}"
    return "-"


def markdown(results: dict, cfg) -> str:
    """Tables: tok/s per system and concurrency, latency/TTFT/acceptance, ratios, greedy check."""
    runs = [r for r in results["runs"] if "metrics" in r]
    cs = sorted({r["concurrency"] for r in runs})
    systems = list(dict.fromkeys(r["system"] for r in runs))
    get = {(r["system"], r["concurrency"]): r for r in runs}
    meta = results["meta"]
    lines = [f"# Engines compare ({meta['date_utc']}, {meta['machine']}, commit {meta['git_commit'][:10]})", "",
             f"`{meta['command']}`", "",
             f"target `{cfg.target}`, draft `{cfg.draft or 'default'}`, {cfg.dtype}, k = {cfg.k} (ours), m = {cfg.m} "
             f"(psd/auto: 2 batches of m; ar/sd/vLLM: 2m), {cfg.max_tokens} output tokens"
             + (", ignore_eos" if cfg.ignore_eos else "") + f", T = {cfg.temperature:g}"
             + (f", **BENCHMARK-ONLY fixed acceptance {cfg.fixed_acceptance:g}** (not the target distribution)"
                if cfg.fixed_acceptance is not None else ""), "",
             "Output tokens/s:", "", "| system | " + " | ".join(f"c={c}" for c in cs) + " |",
             "|---|" + "---|" * len(cs)]
    for s in systems:
        lines.append(f"| {s} | " + " | ".join(_fmt(_tok_s(get[(s, c)])) if (s, c) in get else "-" for c in cs) + " |")
    lines += ["", "TTFT p50 / latency p50 / inter-token latency p99 and max (ms), mean acceptance length, step split (ms: draft / verify / wall; "
              "around the call: the coordinator and gRPC around the step's last-ending engine call, "
              "lead + RPC beyond its compute + tail, psd's parallel steps else the others; its RPC part "
              "split into the service's own time / gRPC transport and client (request + response); TPOT p50: "
              "ms per output token after the first; per engine step: of a vLLM verifier's call, ms in vLLM's "
              "engine core + the worker's own work, per engine step):", "",
              "| system | c | TTFT p50 | latency p50 | TPOT p50 | ITL p99 / max | accept len | draft | verify "
              "| per engine step | step wall | around the call | RPC: service / transport | failed requests |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m, split = r["metrics"], r.get("step_split") or {}
        lines.append(f"| {r['system']} | {r['concurrency']} | {_fmt(m['ttft_ms_p50'], 0)} | {_fmt(m['latency_ms_p50'], 0)} "
                     f"| {_fmt(m.get('tpot_ms_p50'), 2)} | {_fmt(m.get('itl_ms_p99'), 0)} / {_fmt(m.get('itl_ms_max'), 0)} "
                     f"| {_fmt(m['mean_acceptance_length'], 2)} | {_fmt(split.get('draft_ms'), 2)} "
                     f"| {_fmt(split.get('verify_ms'), 2)} | {per_engine_step(split)} | {_fmt(split.get('wall_ms'), 2)} "
                     f"| {_fmt(around_the_call(split), 2)} | {rpc_extra_split(split)} | {m['num_errors']} |")
    lines += ["", "Ratios (tok/s):", "", "| c | best ours / best vLLM | ours / vllm-ar | psd / best vllm-sd |",
              "|---|---|---|---|"]
    for row in results["ratios"]:
        over_ar = ", ".join(f"{n} {v:.2f}x" for n, v in row["over_vllm_ar"].items())
        psd = ", ".join(f"{n} {v:.2f}x ({row['best_vllm_sd']})" for n, v in row.get("psd_over_best_vllm_sd", {}).items())
        lines.append(f"| {row['concurrency']} | {row['best_ours']} / {row['best_vllm']} = "
                     f"{row['best_ours_over_best_vllm']:.2f}x | {over_ar} | {psd or '-'} |")
    if cfg.fixed_acceptance is not None:
        lines += ["", "Greedy outputs: with fixed acceptance only `ar` systems are comparable token for token "
                      "(speculative outputs follow the benchmark-only acceptance, not the target):", ""]
        lines += [f"- {g['system']} c={g['concurrency']}: {g['num_equal']}/{g['num_compared']} equal to vllm-ar"
                  + _repeat_note(g) for g in results["greedy_vs_vllm_ar"] if g["system"].startswith("ar-")]
    elif results["greedy_vs_vllm_ar"]:
        lines += ["", "Greedy outputs equal to vllm-ar's (same prompts, same concurrency):", ""]
        lines += [f"- {g['system']} c={g['concurrency']}: {g['num_equal']}/{g['num_compared']}" + _repeat_note(g)
                  for g in results["greedy_vs_vllm_ar"]]
    lines += [f"\n**FAILED** {f['system']}: `{f['error'][-500:]}`" for f in results["failures"]]
    lines += not_measured(results["runs"])
    lines += shared_engines(results["runs"])
    return "\n".join(lines) + "\n"


def shared_engines(runs: list[dict]) -> list[str]:
    """A line per engine start that several systems ran on (``bench.engines.shared_engines``):
    which systems, the engines' start-up and each system's own (its coordinator and gateway)."""
    groups: dict[tuple[str, float], dict[str, float]] = {}
    for r in runs:
        if "shared_engines" in r:
            groups.setdefault((r["shared_engines"], r["engines_startup_s"]), {})[r["system"]] = r["startup_s"]
    return [f"\nShared engines: {', '.join(systems)} ran on one start of the engines ({start_s:.0f} s), each behind "
            f"its own coordinator and gateway (started in {', '.join(f'{s:.1f}' for s in systems.values())} s)"
            for (_, start_s), systems in groups.items()]


def not_measured(runs: list[dict]) -> list[str]:
    """A line per system that started but was not measured at some concurrency (``skipped``:
    e.g. the time budget ran out after its start-up), so an empty table says why."""
    skipped = {}
    for r in runs:
        if "skipped" in r:
            skipped.setdefault((r["system"], r["skipped"], r.get("startup_s")), []).append(r["concurrency"])
    return [f"\n**NOT MEASURED** {system} at c = {', '.join(map(str, cs))}: {why}"
            + ("" if startup_s is None else f" (its start-up took {startup_s:.0f} s)")
            for (system, why, startup_s), cs in skipped.items()]


def merge(out_dir: str, result_files: list[str]) -> dict:
    """One results set from several ``results.json`` of the same machine lease (systems run in
    successive device calls): every measured run, each call's command and commit in ``meta``;
    ratios and greedy checks recomputed. Writes ``out_dir/results.{json,md}``."""
    import json
    import os
    from types import SimpleNamespace

    parts = [json.load(open(path, encoding="utf-8")) for path in result_files]
    outputs = {}
    for path in result_files:
        outputs_path = os.path.join(os.path.dirname(path), "outputs.json")
        if os.path.isfile(outputs_path):
            outputs.update(json.load(open(outputs_path, encoding="utf-8")))
    runs = [r for p in parts for r in p["runs"] if "metrics" in r]
    measured = {r["system"] for r in runs}   # a failure of a system that a later call measured is superseded
    records = [{**r, "outputs": outputs.get(f"{r['system']}-c{r['concurrency']}", {})} for r in runs]
    meta = {**parts[0]["meta"], "command": " ; ".join(p["meta"]["command"] for p in parts),
            "calls": [{"date_utc": p["meta"]["date_utc"], "command": p["meta"]["command"],
                       "git_commit": p["meta"]["git_commit"]} for p in parts]}
    results = {"meta": meta, "runs": runs, "ratios": ratios_by_concurrency(records),
               "greedy_vs_vllm_ar": [] if parts[0]["meta"]["config"]["temperature"] else greedy_vs_reference(records),
               "failures": [f for p in parts for f in p["failures"]
                            if not f["error"].startswith("skipped") and f["system"] not in measured]}
    meta["superseded_failures"] = [f"{f['system']}: {f['error'][-300:]}" for p in parts for f in p["failures"]
                                   if f["system"] in measured]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown(results, SimpleNamespace(**parts[0]["meta"]["config"])))
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.engines.report_compare",
                                     description="merge the results.json of several device calls of one lease")
    parser.add_argument("out_dir")
    parser.add_argument("results", nargs="+", help="results.json files (each with its outputs.json beside it)")
    args = parser.parse_args()
    merge(args.out_dir, args.results)
