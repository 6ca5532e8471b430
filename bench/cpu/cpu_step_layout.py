"""CPU step time of our ModelRunner with the batched vs the row-wise slot-attention layout.

Issue 8: in the benchmark stack, the 8 or 16 resident requests have ragged contexts (Spec-Bench
prompts of ~50 to ~1300 tokens) and, after some requests finished, slots that are not
consecutive in batch order. The batched layout then gathers every row's cache prefix padded to
the longest row (``index_select`` copies of ``[b, KVH, kv_len, d]`` per layer for K and V); the
row-wise layout (``specdec.kv.slot_attention``, the CPU default) attends each row over a view of its
own prefix. Both layouts run in one process on the same cache, interleaved step by step, with
``torch.set_num_threads(1)``; the thread CPU ms (work done by this thread) is reported, as the
host is shared. Also checks that both layouts pick the same argmax tokens.

Usage:
    python -m bench.cpu.cpu_step_layout [--model smollm2-135m-instruct] [--num-iters 5]
        [--out bench/results/arperf/cpu_step_layout]    # writes .json and .md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.cpu.cpu_step import write_results
from specdec.config import CacheConfig, ModelConfig
from specdec.engine.runner import ModelRunner

CONTEXTS = (80, 150, 300, 500, 700, 900, 1100, 1300)   # tokens per resident row (two of each for 16)
MAX_MODEL_LEN = 2048
FIRST_TOKEN_ID = 1000
# (name, rows in batch order, tokens per row): rows index the resident slots 0..15
CASES = (
    ("decode b1, context 1300", (7,), 1),
    ("decode b8, ragged, slots descending", tuple(range(7, -1, -1)), 1),
    ("decode b8, ragged, slots ascending", tuple(range(8)), 1),
    ("decode b16, ragged, slots descending", tuple(range(15, -1, -1)), 1),
    ("verify b4 k=4, ragged", (6, 4, 2, 0), 5),
    ("verify b8 k=4, ragged", tuple(range(7, -1, -1)), 5),
)


def _runner(model: str, dtype: str) -> tuple[ModelRunner, list[int]]:
    """A runner whose 16 slots hold ``CONTEXTS`` twice (random prompt tokens, seed 0)."""
    cfg = ModelConfig(model=model, dtype=dtype, num_threads=1)
    runner = ModelRunner(cfg, CacheConfig(max_num_seqs=2 * len(CONTEXTS), max_model_len=MAX_MODEL_LEN))
    slots = [runner.allocate_slot() for _ in range(2 * len(CONTEXTS))]
    gen = torch.Generator().manual_seed(0)
    for slot, context in zip(slots, CONTEXTS * 2):
        runner.prefill([slot], [torch.randint(100, 20000, (context,), generator=gen).tolist()])
    return runner, slots


def _step(runner: ModelRunner, order: list[int], q_len: int, is_rowwise: bool) -> tuple[float, torch.Tensor]:
    """One forward of ``q_len`` tokens per row in the given layout; (thread CPU ms, argmax
    ``[b, q_len]``); the KV cache is rolled back afterwards."""
    runner.cache.is_rowwise = is_rowwise
    lens = [runner.seq_len(slot) for slot in order]
    rows = [[FIRST_TOKEN_ID + j for j in range(q_len)]] * len(order)
    start = time.thread_time()
    tokens = runner.forward(order, rows).argmax(-1)
    cpu_ms = (time.thread_time() - start) * 1e3
    for slot, length in zip(order, lens):
        runner.truncate(slot, length)
    return cpu_ms, tokens


def time_cases(model: str, dtype: str, num_iters: int) -> list[dict]:
    """Median thread-CPU ms per case and layout, interleaved, plus the argmax check."""
    runner, slots = _runner(model, dtype)
    results = []
    for name, rows, q_len in CASES:
        order = [slots[row] for row in rows]
        samples: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, torch.Tensor] = {}
        for _ in range(num_iters + 1):                       # the first round warms up
            for is_rowwise in (False, True):
                cpu_ms, tokens[is_rowwise] = _step(runner, order, q_len, is_rowwise)
                samples[is_rowwise].append(cpu_ms)
        batched, rowwise = (statistics.median(samples[mode][1:]) for mode in (False, True))
        results.append({"case": name, "batch": len(rows), "q_len": q_len,
                        "contexts": [CONTEXTS[row % len(CONTEXTS)] for row in rows],
                        "batched_cpu_ms": round(batched, 1), "rowwise_cpu_ms": round(rowwise, 1),
                        "speedup": round(batched / rowwise, 2),
                        "same_argmax": bool(torch.equal(tokens[False], tokens[True]))})
    runner.cache.is_rowwise = True
    return results


def _markdown(result: dict) -> str:
    lines = [f"# CPU step: batched vs row-wise slot attention ({result['model']}, {result['dtype']})", "",
             f"- command: `{result['command']}`",
             "- one torch thread; median thread-CPU ms of the timed steps, layouts interleaved; "
             "shared host: absolute ms are noisy, compare within a row",
             f"- resident contexts (tokens): {list(CONTEXTS)} (x2 for 16 slots)", "",
             "| case | batched ms | row-wise ms | speed-up | same argmax |", "|---|---|---|---|---|"]
    for r in result["cases"]:
        lines.append(f"| {r['case']} | {r['batched_cpu_ms']} | {r['rowwise_cpu_ms']} | {r['speedup']}x | "
                     f"{'yes' if r['same_argmax'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--out", default="bench/results/arperf/cpu_step_layout")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"model": args.model, "dtype": args.dtype,
              "command": "python -m bench.cpu.cpu_step_layout " + " ".join(sys.argv[1:] if argv is None else argv),
              "cases": time_cases(args.model, args.dtype, args.num_iters)}
    write_results(args.out, result, _markdown(result))
    return result


if __name__ == "__main__":
    main()
