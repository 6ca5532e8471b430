"""``python -m bench.engines.draft_calls``: what one ``VllmDraftWorker.draft`` call costs, per
engine set-up, side by side in one process.

A draft engine is built for each ``--setups`` entry (``drafting``: ``drafting_config``'s block
size, step budget and CUDA graphs, the drafter's default: whole graphs, FULL, up to the catch-up
step's size; ``drafting-piecewise``: the same sizes with vLLM's default ``cudagraph_mode``
FULL_AND_PIECEWISE, piecewise graphs for the catch-up step; ``vllm-default``: vLLM's platform
block size, 128 on CPU and 16 on CUDA, a step budget of ``max(max_model_len, max_num_seqs)`` and
its default graphs, FULL_AND_PIECEWISE up to ``2 x max_num_seqs`` tokens, the drafter before
session 20; ``sessions``: ``drafting``'s engine without prefix caching behind
``VllmSessionDraftWorker``, resident draft requests; ``proposer``: ``drafting``'s engine with
``proposer_tokens`` k - 1, vLLM's draft-model proposer drafting tokens 2..k inside the call's one
engine step, ``--draft-proposer``); then at each ``--rows`` n, the set-ups in turn: n requests with prompts of P + 5 i tokens
(``--prompt-tokens`` P, 8 by default; the stack's Spec-Bench prompts average a few hundred) are
admitted, and ``--num-calls`` draft calls of k tokens follow, each after committing 1 to k + 1
random tokens per row (the tokens a verify step commits). Per call: wall ms, engine steps, ms in
``LLMEngine.add_request`` and in engine-core steps, the first step's ms (the catch-up) and the
later steps' (decode); beside them the floor, ms per step of vLLM's own decode loop on the same
engine with n requests resident (what a drafter whose requests stayed in the engine would pay per
draft token), and the share of its draft tokens equal to the first set-up's (same prompts and
committed tokens, greedy: a graph mode that computed wrongly would show here). Writes
``results.json`` and ``results.md`` to ``--out-dir``.

    python -m bench.engines.draft_calls --device cpu --dtype float32 --draft random:tiny-llama-hd64 \\
        --enforce-eager --rows 4,16,64 --out-dir bench/results/draft_calls_cpu
    python -m bench.engines.draft_calls --draft drafts/smollm2-135m-instruct --target smollm2-135m-instruct \\
        --rows 1,8,32 --setups drafting,proposer --out-dir /tmp/draft_calls   # table (a)'s distilled draft
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import random
import sys
import time

from bench.engines.draft_call_timing import Timed, profiled_ms

SETUPS = ("drafting", "drafting-piecewise", "vllm-default", "sessions", "proposer")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.engines.draft_calls")
    p.add_argument("--draft", required=True, help="a model dir or a random: preset (specdec.vllm_backend.models)")
    p.add_argument("--target", default=None, help="the target model, for a MineDraft draft dir (--draft drafts/...: "
                   "it borrows the target's embeddings and head), e.g. smollm2-135m-instruct")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rows", default="4,16,64", help="comma-separated batch sizes")
    p.add_argument("--num-calls", type=int, default=20)
    p.add_argument("--num-warmup", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=8, help="row i's prompt: this many + 5 i tokens")
    p.add_argument("--profile", action="store_true", help="cProfile the timed calls: ms per call in vLLM's "
                   "admission, scheduling, KV-cache bookkeeping and model run (results.json, profile_ms_per_call; "
                   "the profiled calls run slower by cProfile's overhead)")
    p.add_argument("--slots", type=int, default=0, help="the engines' max_num_seqs (0: the largest --rows; "
                   "the stack's psd drafter has 2m, its sd drafter 4m)")
    p.add_argument("--kv-cache-space-gib", type=float, default=1.0, help="CPU: the KV cache's size")
    p.add_argument("--setups", default="drafting,vllm-default", help=f"comma-separated, from {SETUPS} "
                   "(drafting-piecewise: CUDA only)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out-dir", required=True)
    a = p.parse_args(argv)
    a.rows = [int(n) for n in a.rows.split(",")]
    a.setups = a.setups.split(",")
    if bad := [s for s in a.setups if s not in SETUPS]:
        p.error(f"--setups: unknown {bad}, choose from {SETUPS}")
    longest = a.prompt_tokens + 5 * (max(a.rows) - 1) + (a.num_warmup + a.num_calls) * (a.k + 1) + a.k
    if a.slots and a.slots < max(a.rows):
        p.error(f"--slots: must be >= the largest --rows ({max(a.rows)}), got {a.slots}")
    a.slots = a.slots or max(a.rows)
    if a.prompt_tokens < 1 or longest > a.max_model_len:
        p.error(f"--prompt-tokens: must be >= 1, and the longest row ({longest} tokens after every call) "
                f"must fit --max-model-len {a.max_model_len}")
    return a


def _config(a, setup: str, model: str, load_format: str, max_num_seqs: int):
    from specdec.vllm_backend.engine import VLLM_BLOCK_SIZE, VLLM_CUDAGRAPH_MODE, VllmEngineConfig

    cfg = VllmEngineConfig(model=model, load_format=load_format, device=a.device, dtype=a.dtype,
                           max_num_seqs=max_num_seqs, max_model_len=a.max_model_len,
                           enforce_eager=a.enforce_eager, gpu_memory_utilization=0.2,
                           kv_cache_space_gib=a.kv_cache_space_gib)
    on_cuda = a.device == "cuda"
    if setup == "vllm-default":   # vLLM's own defaults, which drafting_config would otherwise fill in
        return dataclasses.replace(
            cfg, block_size=VLLM_BLOCK_SIZE[a.device], max_num_batched_tokens=cfg.batched_tokens,
            max_cudagraph_capture_size=cfg.vllm_default_cudagraph_capture_size() if on_cuda else None,
            cudagraph_mode=VLLM_CUDAGRAPH_MODE if on_cuda else None)
    if setup == "drafting-piecewise":
        return dataclasses.replace(cfg, cudagraph_mode=VLLM_CUDAGRAPH_MODE)
    if setup == "sessions":
        return dataclasses.replace(cfg, enable_prefix_caching=False)
    if setup == "proposer":
        return dataclasses.replace(cfg, proposer_tokens=a.k - 1)
    return cfg


def _measure(a, worker, timed: Timed, n: int, seed: int, before_call=None) -> dict:
    """``--num-warmup`` then ``--num-calls`` draft calls of n rows (module docstring); ``before_call``
    (if given) runs before each call, untimed (``bench.engines.parallel_drafters``: a barrier)."""
    from specdec.sample.sampling import SamplingParams

    rng, greedy = random.Random(seed), SamplingParams(temperature=0.0, seed=0)
    seqs = {f"n{n}-r{i}": [rng.randrange(3, 1000) for _ in range(a.prompt_tokens + 5 * i)] for i in range(n)}
    worker.add_requests([(rid, seq, greedy) for rid, seq in seqs.items()])
    ids, ms, drafts = list(seqs), [], []
    profile = cProfile.Profile() if a.profile else None
    try:
        for call in range(a.num_warmup + a.num_calls):
            committed = []
            for rid in ids:
                start = len(seqs[rid])
                seqs[rid] += [rng.randrange(3, 1000) for _ in range(rng.randint(1, a.k + 1))]
                committed.append((start, seqs[rid][start:]))
            if call == a.num_warmup:
                timed.reset()
            if profile is not None and call == a.num_warmup:
                profile.enable()
            if before_call is not None:
                before_call()
            t = time.perf_counter()
            rows, _ = worker.draft(ids, committed, a.k)
            drafts += rows
            if call >= a.num_warmup:
                ms.append((time.perf_counter() - t) * 1e3)
                timed.end_call()
    finally:
        if profile is not None:
            profile.disable()
        for rid in ids:
            worker.release(rid)
    calls = len(ms)
    profiled = {"profile_ms_per_call": profiled_ms(profile, calls)} if profile is not None else {}
    return {"rows": n, "k": a.k, "ms_per_call": sum(ms) / calls, "ms_per_call_min": min(ms), "call_ms": ms,
            "steps_per_call": timed.calls["step"] / calls,
            "add_request_ms_per_call": timed.seconds["add_request"] * 1e3 / calls,
            "step_ms_per_call": timed.seconds["step"] * 1e3 / calls,
            "first_step_ms": _mean(timed.first_step_ms), "later_step_ms": _mean(timed.later_step_ms),
            "decode_step_ms": _decode_step_ms(a, worker.engine, n, rng), "drafts": drafts, **profiled}


def _agreement(drafts: list[list[int]], reference: list[list[int]]) -> float:
    """Share of draft tokens equal to the reference set-up's at the same row, call and position
    (the set-ups get the same prompts and committed tokens; greedy drafts differ only where
    numerics differ, e.g. between CUDA-graph modes)."""
    pairs = [(x, y) for row, ref in zip(drafts, reference) for x, y in zip(row, ref)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _decode_step_ms(a, engine, n: int, rng: random.Random) -> float:
    """The floor a draft call's decode steps compare with: ms per step of vLLM's own loop with n
    requests resident and decoding (greedy), steps after the prefill and ``--num-warmup`` x k."""
    from specdec.sample.sampling import SamplingParams
    from specdec.vllm_backend.engine import drain, to_vllm_sampling
    from specdec.vllm_backend.outputs import collect_step

    warmup, steps = a.num_warmup * a.k + 1, a.num_calls * a.k
    names = [f"floor-n{n}-r{i}" for i in range(n)]
    for i, name in enumerate(names):   # one params object per request (to_vllm_sampling's skip_clone)
        params = to_vllm_sampling(SamplingParams(temperature=0.0, seed=0), warmup + steps, with_logprobs=False)
        prompt = [rng.randrange(3, 1000) for _ in range(a.prompt_tokens + 5 * i)]
        engine.add_request(name, {"prompt_token_ids": prompt}, params)
    pending, ms = set(names), []
    while pending:
        t = time.perf_counter()
        outputs = collect_step(engine.step())
        ms.append((time.perf_counter() - t) * 1e3)
        pending -= {name for name, out in outputs.items() if out.finish_reason is not None}
    drain(engine)
    timed = ms[warmup:warmup + steps]
    return _mean(timed)


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Draft calls ({meta['device']}, {meta['dtype']}, {meta['draft']}, k = {meta['k']}, "
             f"{meta['num_calls']} calls per point)", "",
             "| setup | engine start s | block | step budget | graphs up to | rows | ms / call | engine steps / call "
             "| add_request ms | step ms | first step ms | later steps ms | vLLM decode step ms "
             "| drafts = first set-up's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['engine_start_s']:.1f} | {r['block_size']} | "
                     f"{r['max_num_batched_tokens']} | {r['max_cudagraph_capture_size']} | {r['rows']} | "
                     f"{r['ms_per_call']:.1f} | {r['steps_per_call']:.2f} | {r['add_request_ms_per_call']:.1f} | "
                     f"{r['step_ms_per_call']:.1f} | {r['first_step_ms']:.2f} | {r['later_step_ms']:.2f} | "
                     f"{r['decode_step_ms']:.2f} | {r['drafts_equal_to_first_setup']:.3f} |")
    return "\n".join(lines) + "\n"


def resolve_draft(a) -> tuple[str, str]:
    """(model dir, vLLM load format) of ``--draft`` (random presets are written once, cached)."""
    from specdec.vllm_backend.models import resolve_vllm_model

    target_dir = None
    if a.target is not None:
        from specdec.config import ModelConfig
        from specdec.models.resolve import resolve_model_dir
        target_dir = resolve_model_dir(ModelConfig(model=a.target))
    return resolve_vllm_model(a.draft, target_dir)


def build_worker(a, setup: str, model: str, load_format: str):
    """The draft worker of ``setup`` (``SETUPS``) on ``model``, ``a.slots`` request slots."""
    from specdec.vllm_backend.draft import VllmDraftWorker
    from specdec.vllm_backend.draft_sessions import VllmSessionDraftWorker

    worker_cls = VllmSessionDraftWorker if setup == "sessions" else VllmDraftWorker
    return worker_cls(_config(a, setup, model, load_format, a.slots), seed=0)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    from bench.engines.vllm_backend_smoke import allow_another_capture

    model, load_format = resolve_draft(a)
    workers, start_s, failures = {}, {}, {}   # all kept: a collected engine tears down vLLM's process-wide groups
    for setup in a.setups:
        allow_another_capture()
        t = time.perf_counter()
        try:
            workers[setup] = build_worker(a, setup, model, load_format)
        except Exception as exc:   # a set-up vLLM refuses (e.g. a CUDA-graph mode) is reported, the others run
            failures[setup] = f"{type(exc).__name__}: {exc}"
            print("DRAFT_CALLS failed", setup, failures[setup], flush=True)
            continue
        start_s[setup] = time.perf_counter() - t
    timers = {setup: Timed(worker.engine) for setup, worker in workers.items()}
    rows = []
    for n in a.rows:   # the set-ups take turns at each point, so neither gets the process's warm-up
        reference = None   # the first set-up's drafts at this point
        for setup, worker in workers.items():
            vllm_cfg = worker.engine.vllm_config
            point = _measure(a, worker, timers[setup], n, seed=n)
            drafts = point.pop("drafts")
            reference = drafts if reference is None else reference
            rows.append({"setup": setup, "engine_start_s": start_s[setup],
                         "block_size": vllm_cfg.cache_config.block_size,
                         "max_num_batched_tokens": vllm_cfg.scheduler_config.max_num_batched_tokens,
                         "max_cudagraph_capture_size": vllm_cfg.compilation_config.max_cudagraph_capture_size,
                         **point, "drafts_equal_to_first_setup": _agreement(drafts, reference)})
            print("DRAFT_CALLS", json.dumps(rows[-1]), flush=True)
    meta = {"command": "python -m bench.engines.draft_calls " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": a.device, "dtype": a.dtype, "draft": a.draft, "k": a.k, "num_calls": a.num_calls,
            "num_warmup": a.num_warmup, "max_model_len": a.max_model_len, "enforce_eager": a.enforce_eager,
            "prompt_tokens": a.prompt_tokens, "slots": a.slots,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "failures": failures}, f, indent=1)
    with open(os.path.join(a.out_dir, "results.md"), "w") as f:
        f.write(_markdown(rows, meta) + "".join(f"\nFailed: {name}: {why}\n" for name, why in failures.items()))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
