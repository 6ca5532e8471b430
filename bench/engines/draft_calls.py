"""``python -m bench.engines.draft_calls``: what one ``VllmDraftWorker.draft`` call costs, per
engine set-up, side by side in one process.

A draft engine is built for each ``--setups`` entry (``drafting``: ``drafting_config``'s block
size and step budget, the drafter's default; ``vllm-default``: vLLM's platform block size, 128
on CPU and 16 on CUDA, and a step budget of ``max(max_model_len, max_num_seqs)``, the drafter
before session 20); then at each ``--rows`` n, the set-ups in turn: n requests with prompts of 8 + 5 i tokens are
admitted, and ``--num-calls`` draft calls of k tokens follow, each after committing 1 to k + 1
random tokens per row (the tokens a verify step commits). Per call: wall ms, engine steps, ms in
``LLMEngine.add_request`` and in ``LLMEngine.step``. Writes ``results.json`` and ``results.md``
to ``--out-dir``.

    python -m bench.engines.draft_calls --device cpu --dtype float32 --draft random:tiny-llama-hd64 \\
        --enforce-eager --rows 4,16,64 --out-dir bench/results/draft_calls_cpu
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

SETUPS = ("drafting", "vllm-default")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.engines.draft_calls")
    p.add_argument("--draft", required=True, help="a model dir or a random: preset (specdec.vllm_backend.models)")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rows", default="4,16,64", help="comma-separated batch sizes")
    p.add_argument("--num-calls", type=int, default=20)
    p.add_argument("--num-warmup", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-space-gib", type=float, default=1.0, help="CPU: the KV cache's size")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out-dir", required=True)
    a = p.parse_args(argv)
    a.rows = [int(n) for n in a.rows.split(",")]
    a.setups = a.setups.split(",")
    if bad := [s for s in a.setups if s not in SETUPS]:
        p.error(f"--setups: unknown {bad}, choose from {SETUPS}")
    return a


class _Timed:
    """Wraps an engine's ``add_request`` and ``step`` to count calls and seconds."""

    def __init__(self, engine) -> None:
        self.seconds = {"add_request": 0.0, "step": 0.0}
        self.calls = {"add_request": 0, "step": 0}
        for name in self.seconds:
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)


def _config(a, setup: str, model: str, load_format: str, max_num_seqs: int):
    from specdec.vllm_backend.engine import VLLM_BLOCK_SIZE, VllmEngineConfig

    cfg = VllmEngineConfig(model=model, load_format=load_format, device=a.device, dtype=a.dtype,
                           max_num_seqs=max_num_seqs, max_model_len=a.max_model_len,
                           enforce_eager=a.enforce_eager, gpu_memory_utilization=0.2,
                           kv_cache_space_gib=a.kv_cache_space_gib)
    if setup == "vllm-default":
        return dataclasses.replace(cfg, block_size=VLLM_BLOCK_SIZE[a.device], max_num_batched_tokens=cfg.batched_tokens)
    return cfg


def _measure(a, worker, timed: _Timed, n: int, seed: int) -> dict:
    from specdec.sample.sampling import SamplingParams

    rng, greedy = random.Random(seed), SamplingParams(temperature=0.0, seed=0)
    seqs = {f"n{n}-r{i}": [rng.randrange(3, 1000) for _ in range(8 + 5 * i)] for i in range(n)}
    worker.add_requests([(rid, seq, greedy) for rid, seq in seqs.items()])
    ids, ms = list(seqs), []
    try:
        for call in range(a.num_warmup + a.num_calls):
            committed = []
            for rid in ids:
                start = len(seqs[rid])
                seqs[rid] += [rng.randrange(3, 1000) for _ in range(rng.randint(1, a.k + 1))]
                committed.append((start, seqs[rid][start:]))
            if call == a.num_warmup:
                timed.reset()
            t = time.perf_counter()
            worker.draft(ids, committed, a.k)
            if call >= a.num_warmup:
                ms.append((time.perf_counter() - t) * 1e3)
    finally:
        for rid in ids:
            worker.release(rid)
    calls = len(ms)
    return {"rows": n, "k": a.k, "ms_per_call": sum(ms) / calls, "ms_per_call_min": min(ms),
            "steps_per_call": timed.calls["step"] / calls,
            "add_request_ms_per_call": timed.seconds["add_request"] * 1e3 / calls,
            "step_ms_per_call": timed.seconds["step"] * 1e3 / calls}


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Draft calls ({meta['device']}, {meta['dtype']}, {meta['draft']}, k = {meta['k']}, "
             f"{meta['num_calls']} calls per point)", "",
             "| setup | block | step budget | rows | ms / call | engine steps / call | add_request ms | step ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['block_size']} | {r['max_num_batched_tokens']} | {r['rows']} | "
                     f"{r['ms_per_call']:.1f} | {r['steps_per_call']:.2f} | {r['add_request_ms_per_call']:.1f} | "
                     f"{r['step_ms_per_call']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    from bench.engines.vllm_backend_smoke import allow_another_capture
    from specdec.vllm_backend.draft import VllmDraftWorker
    from specdec.vllm_backend.models import resolve_vllm_model

    model, load_format = resolve_vllm_model(a.draft)
    workers = {}   # all kept: a collected engine tears down vLLM's process-wide groups
    for setup in a.setups:
        allow_another_capture()
        workers[setup] = VllmDraftWorker(_config(a, setup, model, load_format, max(a.rows)), seed=0)
    timers = {setup: _Timed(worker.engine) for setup, worker in workers.items()}
    rows = []
    for n in a.rows:   # the set-ups take turns at each point, so neither gets the process's warm-up
        for setup, worker in workers.items():
            vllm_cfg = worker.engine.vllm_config
            rows.append({"setup": setup, "block_size": vllm_cfg.cache_config.block_size,
                         "max_num_batched_tokens": vllm_cfg.scheduler_config.max_num_batched_tokens,
                         **_measure(a, worker, timers[setup], n, seed=n)})
            print("DRAFT_CALLS", json.dumps(rows[-1]), flush=True)
    meta = {"command": "python -m bench.engines.draft_calls " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": a.device, "dtype": a.dtype, "draft": a.draft, "k": a.k, "num_calls": a.num_calls,
            "num_warmup": a.num_warmup, "max_model_len": a.max_model_len, "enforce_eager": a.enforce_eager,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(a.out_dir, "results.md"), "w") as f:
        f.write(_markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
