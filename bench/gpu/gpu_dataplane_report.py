"""Markdown report of ``bench/gpu/gpu_dataplane.py`` results: data-plane ms per plane, verify-step ms,
and the data-plane share of a step = dp_ms / (dp_ms + verify_ms) (MineDraft paper Table 1)."""

from __future__ import annotations

from bench.gpu.gpu_dataplane_models import PRESETS

PLANE_NAMES = {"nccl": "NCCL (dist)", "ipc": "CUDA IPC", "inline": "inline protobuf (lower bound)",
               "ids": "token ids only (T=0)"}


def _key(row: dict) -> tuple:
    return row["plane"], row["vocab"], row["dtype"], row["b"], row["k"]


def shares(result: dict) -> list[dict]:
    """Rows {model, plane, dtype, b, k, dp_ms, verify_ms, share} for every measured pair."""
    verify = {(r["model"], r["b"], r["k"]): r["verify_ms"] for r in result["verify"]}
    out = []
    for row in result["planes"]:
        for model, shape in PRESETS.items():
            step = verify.get((model, row["b"], row["k"]))
            if step is None or shape["vocab_size"] != row["vocab"]:
                continue
            out.append({"model": model, "plane": row["plane"], "dtype": row["dtype"], "b": row["b"], "k": row["k"],
                        "dp_ms": row["total_ms"], "verify_ms": step,
                        "share": row["total_ms"] / (row["total_ms"] + step)})
    return out


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(line) + " |" for line in lines)]


def winner(result: dict) -> dict:
    """Per (vocab, dtype, b, k): which of nccl / ipc had the lower median total; counts + ratio."""
    by_key = {_key(r): r["total_ms"] for r in result["planes"]}
    counts, ratios = {"nccl": 0, "ipc": 0}, []
    for (plane, vocab, dtype, b, k), ipc_ms in by_key.items():
        nccl_ms = by_key.get(("nccl", vocab, dtype, b, k))
        if plane != "ipc" or nccl_ms is None:
            continue
        counts["ipc" if ipc_ms < nccl_ms else "nccl"] += 1
        ratios.append(nccl_ms / ipc_ms)
    ratios.sort()
    return {"wins": counts, "median_nccl_over_ipc": ratios[len(ratios) // 2] if ratios else None}


def write_report(result: dict, path: str) -> None:
    ks = sorted({r["k"] for r in result["planes"]})
    lines = [f"# GPU data plane ({result['device_name']}, torch {result['torch']})", "",
             f"Command: `{result['command']}`", "",
             f"Drafter on {result['drafter_device']}, verifier rank 0 on {result['verifier_device']}. "
             "Data-plane ms = drafter side + verifier side, median; inline excludes the gRPC hops (lower bound).", ""]
    for vocab in sorted({r["vocab"] for r in result["planes"]}):
        lines += [f"## Data-plane ms per step, V = {vocab}", ""]
        rows = sorted({(r["dtype"], r["b"], r["plane"]) for r in result["planes"] if r["vocab"] == vocab})
        by_key = {_key(r): r for r in result["planes"]}
        body = [[PLANE_NAMES[p], d, str(b)] + [f"{by_key[(p, vocab, d, b, k)]['total_ms']:.3f}"
                                              if (p, vocab, d, b, k) in by_key else "" for k in ks]
                for d, b, p in rows]
        lines += _table(["plane", "dtype", "b", *(f"k={k}" for k in ks)], body) + [""]
    if result["verify"]:
        vks = sorted({r["k"] for r in result["verify"]})
        by = {(r["model"], r["b"], r["k"]): r["verify_ms"] for r in result["verify"]}
        models_b = sorted({(r["model"], r["b"]) for r in result["verify"]})
        lines += ["## Verify step ms (TargetWorker.verify, eager bf16, random weights; k = 0: decode)", ""]
        lines += _table(["model", "b", *(f"k={k}" for k in vks)],
                        [[m, str(b)] + [f"{by[(m, b, k)]:.2f}" for k in vks] for m, b in models_b]) + [""]
        share_rows = shares(result)
        keys = sorted({(s["model"], s["dtype"], s["b"], s["plane"]) for s in share_rows})
        sb = {(s["model"], s["dtype"], s["b"], s["plane"], s["k"]): s["share"] for s in share_rows}
        lines += ["## Data-plane share of a step, dp / (dp + verify), %", ""]
        lines += _table(["model", "plane", "dtype", "b", *(f"k={k}" for k in ks)],
                        [[m, PLANE_NAMES[p], d, str(b)] + [f"{100 * sb[(m, d, b, p, k)]:.2f}"
                                                           if (m, d, b, p, k) in sb else "" for k in ks]
                         for m, d, b, p in keys]) + [""]
    checked = [r["num_checksum_mismatches"] for r in result["planes"] if "num_checksum_mismatches" in r]
    lines += [f"Exactness: {sum(checked)} checksum mismatches in {len(checked)} checked configurations."
              if checked else "Exactness: not checked in this run (checksums were added after it).", ""]
    win = winner(result)
    lines += [f"IPC vs NCCL: IPC faster in {win['wins']['ipc']} of {sum(win['wins'].values())} configurations; "
              f"median NCCL/IPC time ratio {win['median_nccl_over_ipc']}.", ""]
    with open(path, "w") as handle:
        handle.write("\n".join(lines))
