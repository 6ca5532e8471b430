"""CPU step time of our ModelRunner: float32 vs bfloat16, one thread, real target weights.

Measures, in process and with ``torch.set_num_threads(1)``, the wall time (ms) of one runner
forward for decode steps (1 new token per row) at batch 1/4/8 and for a verify step of
``k + 1`` tokens per row at batch 4, each over a KV prefix of ``--context`` tokens, for every
``--dtypes`` entry; plus a ``torch.profiler`` breakdown of one batch-4 decode step into model
matmuls, attention (SDPA + slot-cache reads/writes), other aten ops, and Python/framework
overhead (step wall time minus the self CPU time of all aten ops).

Issue 8 ("our ar should match vLLM's CPU ar"). The host is shared by several processes, so
both the median and the min of ``--num-iters`` timed steps are reported; the min is the better
estimate of the uncontended cost.

Usage:
    python -m bench.cpu.cpu_step [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
        [--out bench/results/cpu_step]   # writes cpu_step.json and cpu_step.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.engine.runner import ModelRunner

CONTENDED_RATIO = 1.1  # wall > 1.1 x thread CPU time: the step lost its core to other processes
MAX_PROFILE_ATTEMPTS = 4  # re-profile a contended step (profiler self times are wall based)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
ATTENTION_OPS = ("scaled_dot_product", "aten::index_put", "aten::index_select", "aten::index",
                 "aten::_flash_attention", "aten::repeat_interleave", "aten::expand")


def _setup(model: str, dtype: str, batch: int, context: int, q_len: int,
           static_shapes: bool) -> tuple[ModelRunner, list[int]]:
    """A runner with ``batch`` slots each prefilled with ``context`` tokens."""
    cfg = ModelConfig(model=model, dtype=dtype, num_threads=1, static_shapes=static_shapes,
                      max_static_tokens=max(q_len, 1))
    runner = ModelRunner(cfg, CacheConfig(max_num_seqs=batch, max_model_len=context + 512))
    slots = [runner.allocate_slot() for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    for slot in slots:
        prompt = torch.randint(100, 20000, (context,), generator=gen).tolist()
        runner.prefill([slot], [prompt])
    return runner, slots


def _step(runner: ModelRunner, slots: list[int], q_len: int) -> tuple[float, float]:
    """One forward of ``q_len`` tokens per row (plus the argmax); returns (wall ms, CPU ms of
    this thread: the work done, excluding time the shared host gave to other processes); the
    KV cache is rolled back afterwards."""
    lens = [runner.seq_len(s) for s in slots]
    rows = [[1000 + i] * q_len for i in range(len(slots))]
    start, cpu_start = time.perf_counter(), time.thread_time()
    runner.forward(slots, rows).argmax(-1)
    wall_ms = (time.perf_counter() - start) * 1e3
    cpu_ms = (time.thread_time() - cpu_start) * 1e3
    for slot, length in zip(slots, lens):
        runner.truncate(slot, length)
    return wall_ms, cpu_ms


def time_case(model: str, dtype: str, batch: int, q_len: int, context: int, num_warmup: int,
              num_iters: int, static_shapes: bool) -> dict:
    """Median/min/max wall ms of ``num_iters`` steps after ``num_warmup`` untimed steps."""
    runner, slots = _setup(model, dtype, batch, context, q_len, static_shapes)
    for _ in range(num_warmup):
        _step(runner, slots, q_len)
    samples = [_step(runner, slots, q_len) for _ in range(num_iters)]
    times = [wall for wall, _ in samples]
    median, cpu_median = statistics.median(times), statistics.median(c for _, c in samples)
    return {"dtype": dtype, "batch": batch, "q_len": q_len, "context": context,
            "static_shapes": static_shapes, "median_ms": round(median, 2),
            "min_ms": round(min(times), 2), "max_ms": round(max(times), 2),
            "cpu_median_ms": round(cpu_median, 2), "num_iters": num_iters,
            "tokens_per_s_median": round(batch * 1e3 / median, 1),
            "tokens_per_s_cpu": round(batch * 1e3 / cpu_median, 1)}


def profile_case(model: str, dtype: str, batch: int, q_len: int, context: int,
                 num_steps: int = 5) -> dict:
    """Self CPU ms per step (mean of ``num_steps`` profiled steps) split into matmul /
    attention / other aten / Python overhead; profiler overhead inflates the totals a little."""
    runner, slots = _setup(model, dtype, batch, context, q_len, static_shapes=False)
    for _ in range(3):
        _step(runner, slots, q_len)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        samples = [_step(runner, slots, q_len) for _ in range(num_steps)]
    wall_ms = sum(w for w, _ in samples) / num_steps
    cpu_ms = sum(c for _, c in samples) / num_steps
    buckets = {"matmul_ms": 0.0, "attention_ms": 0.0, "other_aten_ms": 0.0}
    top_ops: list[tuple[str, float]] = []
    for evt in prof.key_averages():
        self_ms = evt.self_cpu_time_total / 1e3 / num_steps
        if not evt.key.startswith("aten::") and "scaled_dot_product" not in evt.key:
            continue
        top_ops.append((evt.key, self_ms))
        if any(evt.key.startswith(op) for op in MATMUL_OPS):
            buckets["matmul_ms"] += self_ms
        elif any(op in evt.key for op in ATTENTION_OPS):
            buckets["attention_ms"] += self_ms
        else:
            buckets["other_aten_ms"] += self_ms
    aten_ms = sum(buckets.values())
    top_ops.sort(key=lambda item: -item[1])
    return {"dtype": dtype, "batch": batch, "q_len": q_len, "context": context,
            "wall_ms": round(wall_ms, 2), "cpu_ms": round(cpu_ms, 2),
            **{k: round(v, 2) for k, v in buckets.items()},
            "python_overhead_ms": round(wall_ms - aten_ms, 2),
            "is_contended": wall_ms > CONTENDED_RATIO * cpu_ms,
            "top_ops": [(name, round(ms, 2)) for name, ms in top_ops[:10]]}


def _profile_uncontended(model: str, dtype: str, batch: int, q_len: int, context: int) -> dict:
    """``profile_case`` repeated (up to ``MAX_PROFILE_ATTEMPTS``) until a profile is not
    contended; the last one is returned either way, flagged by ``is_contended``."""
    for _ in range(MAX_PROFILE_ATTEMPTS):
        result = profile_case(model, dtype, batch, q_len, context)
        if not result["is_contended"]:
            break
    return result


def _markdown(result: dict) -> str:
    lines = [f"# CPU step time of our ModelRunner ({result['model']})", "",
             f"- command: `{result['command']}`",
             f"- machine: {result['machine']}; torch {result['torch']}; 1 torch thread",
             "- shared host (other processes running): wall min and the thread CPU ms (work done "
             "by this thread, excluding time given to other processes) are the better estimates "
             "of the uncontended cost; CPU ms still includes cache/bandwidth contention",
             "- profile: self times are wall based; a 'contended' row (wall > 1.1 x thread CPU) "
             "lost its core to other processes during profiling and its split is unreliable", "",
             "| dtype | static | batch | tokens/row | context | median ms | min ms | max ms | "
             "CPU ms (median) | tok/s (median) | tok/s (CPU ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["steps"]:
        lines.append(f"| {r['dtype']} | {r['static_shapes']} | {r['batch']} | {r['q_len']} | "
                     f"{r['context']} | {r['median_ms']} | {r['min_ms']} | {r['max_ms']} | "
                     f"{r['cpu_median_ms']} | {r['tokens_per_s_median']} | "
                     f"{r['tokens_per_s_cpu']} |")
    lines += ["", "## Profile of one step (self CPU ms)", "",
              "| dtype | batch | tokens/row | wall | thread CPU | matmul | attention | other aten | "
              "Python/framework (wall - aten) | contended |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["profiles"]:
        lines.append(f"| {p['dtype']} | {p['batch']} | {p['q_len']} | {p['wall_ms']} | "
                     f"{p['cpu_ms']} | {p['matmul_ms']} | {p['attention_ms']} | {p['other_aten_ms']} | "
                     f"{p['python_overhead_ms']} | {'yes' if p['is_contended'] else 'no'} |")
    for p in result["profiles"]:
        ops = ", ".join(f"{name} {ms}" for name, ms in p["top_ops"])
        lines += ["", f"Top aten ops ({p['dtype']}, batch {p['batch']}, {p['q_len']} tokens/row): "
                      f"{ops}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,4,8", help="decode batch sizes")
    parser.add_argument("--k", type=int, default=4, help="verify step: k + 1 tokens per row")
    parser.add_argument("--verify-batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=256, help="KV prefix tokens per row")
    parser.add_argument("--num-warmup", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--static-shapes", action="store_true",
                        help="also time the static-shape path (CPU twin of the graph path)")
    parser.add_argument("--out", default="bench/results/cpu_step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtypes = args.dtypes.split(",")
    cases = [(b, 1) for b in map(int, args.batches.split(","))] + [(args.verify_batch, args.k + 1)]
    modes = [False, True] if args.static_shapes else [False]
    steps = [time_case(args.model, dt, b, q, args.context, args.num_warmup, args.num_iters, st)
             for dt in dtypes for st in modes for b, q in cases]
    profiles = [_profile_uncontended(args.model, dt, b, q, args.context) for dt in dtypes
                for b, q in ((1, 1), (4, 1), (args.verify_batch, args.k + 1))]
    import sys

    result = {"model": args.model, "command": "python -m bench.cpu.cpu_step " + " ".join(sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, "
                         f"{torch.get_num_threads()} thread(s)",
              "torch": torch.__version__, "steps": steps, "profiles": profiles}
    write_results(args.out, result, _markdown(result))
    return result


def write_results(out_stem: str, result: dict, markdown: str) -> None:
    """Write ``<out_stem>.json`` and ``<out_stem>.md`` (parent folders created) and print the Markdown."""
    out = Path(out_stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
