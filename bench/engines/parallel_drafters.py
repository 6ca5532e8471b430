"""``python -m bench.engines.parallel_drafters``: would psd's drafter go faster as several processes?

On the H100 of session 30 (BENCHMARKS.md) psd's step at c = 64 is its Draft call: 32 rows, k = 4,
31.9 ms, four vLLM engine steps whose host work (vLLM's scheduler, input preparation, output
processing: 3-5 ms a step around ~1 ms of a 0.6B model's GPU work) runs in one Python thread. A
drafter split into P processes of R / P rows each (each request homed on one of them) would run
those steps side by side on P host cores. This measures that before the stack is built for it: for
each P of ``--processes``, P processes each build the same draft engine (``bench.engines.draft_calls``'
``--setup``) with R / P of the ``--rows`` R and make ``--num-calls`` draft calls after
``--num-warmup``, each call started at one barrier across the P processes, as the coordinator's
fan-out would start them; a call takes as long as its slowest process. The engines start one
after another (vLLM sizes its KV cache from the GPU memory it finds free, which another process's
concurrent start would change under it), then wait at the barrier. With ``--cuda-mps`` the
processes share the GPU through a private MPS daemon (``minedraft.cuda_mps``), as the stack's
engines do. Not measured here: the verifier's forward beside them (the stack's first draft step
took 14.1 ms against 7.6 alone, session 30).

Every other flag is ``bench.engines.draft_calls``' (``--draft``, ``--k``, ``--prompt-tokens``, ...).
Writes ``results.json`` and ``results.md`` to ``--out-dir``.

    python -m bench.engines.parallel_drafters --draft random:qwen3-0.6b --rows 32 --processes 1,2,4 \\
        --setup sessions --prompt-tokens 400 --max-model-len 1024 --cuda-mps --out-dir /tmp/parallel_drafters
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue as queue_module
import sys
import time

from bench.engines import draft_calls
from bench.engines.draft_call_timing import Timed

BARRIER_TIMEOUT_S = 600.0   # a process that never reaches the barrier (its engine failed) ends the others' wait
RESULT_TIMEOUT_S = 1800.0   # the slowest process's engine start and calls
POLL_S = 5.0                # how often the parent looks for a process that died without reporting


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.engines.parallel_drafters",
                                description="draft calls of R rows in one process against R / P rows in each of P")
    p.add_argument("--rows", type=int, default=32, help="rows of one draft call, split over the processes")
    p.add_argument("--processes", default="1,2", help="comma-separated process counts, each dividing --rows")
    p.add_argument("--setup", default="sessions", choices=draft_calls.SETUPS)
    p.add_argument("--cuda-mps", action="store_true", help="share the GPU through a private MPS daemon")
    p.add_argument("--out-dir", required=True)
    a, rest = p.parse_known_args(argv)
    a.processes = [int(n) for n in a.processes.split(",")]
    if bad := [n for n in a.processes if n < 1 or a.rows % n]:
        p.error(f"--processes: each must be >= 1 and divide --rows {a.rows}, got {bad}")
    a.child_argv = {n: rest + ["--rows", str(a.rows // n), "--setups", a.setup, "--out-dir", a.out_dir]
                    for n in a.processes}
    children = [draft_calls._parse(child_argv) for child_argv in a.child_argv.values()]   # their errors first
    a.child = children[0]   # the draft, k, device: the same in every process
    return a


def _child(argv: list[str], index: int, model: str, load_format: str, start_lock, barrier, results) -> None:
    """One process of a run: build the engine (one process at a time), make the calls at the
    barrier, report (index, point)."""
    try:
        a = draft_calls._parse(argv)
        with start_lock:
            started = time.time()
            worker = draft_calls.build_worker(a, a.setups[0], model, load_format)
            start_span = (started, time.time())
        point = draft_calls._measure(a, worker, Timed(worker.engine), a.rows[0], seed=index,
                                     before_call=lambda: barrier.wait(BARRIER_TIMEOUT_S))
        point.pop("drafts")
        results.put((index, {**point, "engine_start_s": start_span[1] - start_span[0], "engine_start_span": start_span}))
    except BaseException as exc:   # noqa: BLE001 -- reported to the parent; the others leave the barrier
        barrier.abort()
        results.put((index, {"error": f"{type(exc).__name__}: {exc}"[-2000:]}))


def run(a, num_processes: int, model: str, load_format: str) -> dict:
    """One point: ``num_processes`` processes side by side; per call, the slowest one's ms."""
    ctx = multiprocessing.get_context("spawn")
    start_lock, barrier, results = ctx.Lock(), ctx.Barrier(num_processes), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(a.child_argv[num_processes], i, model, load_format, start_lock,
                                              barrier, results)) for i in range(num_processes)]
    for proc in procs:
        proc.start()
    points, deadline = {}, time.monotonic() + RESULT_TIMEOUT_S
    try:
        while len(points) < num_processes and time.monotonic() < deadline:
            try:
                index, point = results.get(timeout=POLL_S)
                points[index] = point
            except queue_module.Empty:   # a process that died without a word (a crash) fails the point
                dead = [i for i, proc in enumerate(procs) if i not in points and proc.exitcode not in (None, 0)]
                points.update({i: {"error": f"process {i} exited with code {procs[i].exitcode}"} for i in dead})
                if dead:
                    barrier.abort()
        points.update({i: {"error": "no result in time"} for i in range(num_processes) if i not in points})
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return summarize(num_processes, a.rows, [points[i] for i in range(num_processes)])


def summarize(num_processes: int, rows: int, points: list[dict]) -> dict:
    """The point's figures from each process's ``draft_calls._measure`` dict (or its error)."""
    errors = [p["error"] for p in points if "error" in p]
    if errors:
        return {"processes": num_processes, "rows": rows, "errors": errors}
    slowest = [max(calls) for calls in zip(*(p["call_ms"] for p in points))]

    def mean(key: str) -> float:
        return sum(p[key] for p in points) / len(points)

    return {"processes": num_processes, "rows": rows, "rows_per_process": rows // num_processes,
            "ms_per_call": sum(slowest) / len(slowest), "ms_per_call_min": min(slowest),
            "process_ms_per_call": [p["ms_per_call"] for p in points], "first_step_ms": mean("first_step_ms"),
            "later_step_ms": mean("later_step_ms"), "steps_per_call": mean("steps_per_call"),
            "engine_start_s": max(p["engine_start_s"] for p in points),
            "engine_start_spans": [p["engine_start_span"] for p in points]}


def _markdown(points: list[dict], meta: dict) -> str:
    lines = [f"# Parallel drafters ({meta['setup']}, {meta['rows']} rows a call, k = {meta['k']}, "
             f"CUDA MPS {'on' if meta['cuda_mps'] else 'off'})", "", f"`{meta['command']}`", "",
             "| processes | rows each | ms / call (slowest process) | min | each process's ms / call "
             "| first step ms | later steps ms | vs 1 process |", "|---|---|---|---|---|---|---|---|"]
    one = next((p["ms_per_call"] for p in points if p["processes"] == 1 and "ms_per_call" in p), None)
    for p in points:
        if "errors" in p:
            lines.append(f"| {p['processes']} | - | failed: {p['errors'][0][:200]} | | | | | |")
            continue
        each = ", ".join(f"{ms:.1f}" for ms in p["process_ms_per_call"])
        ratio = f"{one / p['ms_per_call']:.2f}x" if one else "-"
        lines.append(f"| {p['processes']} | {p['rows_per_process']} | {p['ms_per_call']:.1f} | "
                     f"{p['ms_per_call_min']:.1f} | {each} | {p['first_step_ms']:.2f} | {p['later_step_ms']:.2f} "
                     f"| {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    model, load_format = draft_calls.resolve_draft(a.child)
    daemon = None
    if a.cuda_mps:
        from minedraft.cuda_mps import CudaMpsDaemon
        daemon = CudaMpsDaemon.started(a.out_dir)
        os.environ.update(daemon.env)   # the spawned processes inherit it
    try:
        points = []
        for n in a.processes:
            points.append(run(a, n, model, load_format))
            print("PARALLEL_DRAFTERS", json.dumps(points[-1]), flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
    child = a.child
    meta = {"command": "python -m bench.engines.parallel_drafters " + " ".join(argv if argv is not None else sys.argv[1:]),
            "setup": a.setup, "rows": a.rows, "k": child.k, "draft": child.draft, "device": child.device,
            "cuda_mps": a.cuda_mps, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "points": points}, f, indent=1)
    with open(os.path.join(a.out_dir, "results.md"), "w") as f:
        f.write(_markdown(points, meta))
    return 1 if any("errors" in p for p in points) else 0


if __name__ == "__main__":
    raise SystemExit(main())
