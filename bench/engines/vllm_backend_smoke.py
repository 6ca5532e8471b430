"""``python -m bench.engines.vllm_backend_smoke``: the vLLM backend's workers in one process, greedy sd = ar,
and where the time of a step goes.

Builds ``VllmTargetWorker`` (speculation k) and ``VllmDraftWorker`` for the given models, decodes
``--num-requests`` prompts of random token ids greedily without drafts (ar), then again with
``--k`` drafts per step from the draft worker (sd), and prints whether every sd output equals
its ar output, the accepted tokens per step and the mean verify / draft call times (ms).
``--ar-decode-steps N`` adds the ``ar`` engine (no speculation; vLLM's async scheduling on
cuda): ms per token of one-step calls against N-step calls (``VllmTargetWorker.decode``), outputs
compared. ``--profile-out DIR`` writes cProfile tables (cumulative and own time) of the sd
loop's draft and verify calls there (their ms then include the profiler's overhead). A quick check of the backend on a new
machine (GPU or CPU) before a benchmark, and the profile behind BENCHMARKS.md's gap analysis.

    python -m bench.engines.vllm_backend_smoke --device cuda --target random:smollm2-135m --draft random:smollm2-135m
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import time


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.engines.vllm_backend_smoke")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--num-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=0, help="tokens per prompt (0: 8 + 5 i for request i)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--ar-decode-steps", type=int, default=0, help="also time the ar engine's N-step decode (0: off)")
    p.add_argument("--profile-out", default="", help="write cProfile tables of the sd loop's draft and verify "
                                                          "calls to this dir (the ar timings stay unprofiled)")
    p.add_argument("--enforce-eager", action="store_true")
    return p.parse_args(argv)


class _Calls:
    """Wall ms of calls, optionally under one cProfile per name."""

    def __init__(self, profiled: tuple[str, ...]) -> None:
        self.ms: dict[str, list[float]] = {}
        self.profiles: dict[str, cProfile.Profile] = {}
        self.profiled = profiled

    def run(self, name: str, fn, *args):
        profile = self.profiles.setdefault(name, cProfile.Profile()) if name in self.profiled else None
        t = time.perf_counter()
        result = profile.runcall(fn, *args) if profile else fn(*args)
        self.ms.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
        return result

    def write(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        for name, profile in self.profiles.items():
            for key in ("cumulative", "tottime"):
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats(key).print_stats(45)
                with open(os.path.join(out_dir, f"{name}_{key}.txt"), "w") as f:
                    f.write(text.getvalue())


def _decode_all(target, prompts, n_tokens: int, calls: _Calls, name: str, num_steps: int = 1) -> dict:
    greedy = _greedy()
    out = {rid: [o.token_ids[0]] for rid, o in zip(prompts, target.add_requests([(r, p, greedy) for r, p in prompts.items()]))}
    while min(len(v) for v in out.values()) < n_tokens + 1:
        steps = (calls.run(name, target.decode, list(prompts), num_steps) if num_steps > 1
                 else calls.run(name, target.verify, list(prompts), [[] for _ in prompts], None))
        for rid, o in zip(prompts, steps):
            out[rid] += o.token_ids
    for rid in prompts:
        target.release(rid)
    return out


def allow_another_capture() -> None:
    """vLLM forbids CUDA graph captures once an engine of the process has captured its own (a
    guard against captures during inference); the engine services build one engine per process,
    this script builds several, so it lifts the guard before each further build."""
    from vllm.compilation import monitor

    monitor.set_cudagraph_capturing_enabled(True)


def _greedy():
    from specdec.sample.sampling import SamplingParams

    return SamplingParams(temperature=0.0, seed=0)


def _sd(target, draft, prompts, a, calls: _Calls) -> tuple[dict, list[int]]:
    greedy = _greedy()
    sd = {rid: [o.token_ids[0]] for rid, o in zip(prompts, target.add_requests([(r, p, greedy) for r, p in prompts.items()]))}
    draft.add_requests([(r, p, greedy) for r, p in prompts.items()])
    known = {rid: len(p) for rid, p in prompts.items()}
    accepted = []
    while min(len(v) for v in sd.values()) < a.num_tokens + 1:
        ids = list(prompts)
        committed = [(known[r], sd[r][known[r] - len(prompts[r]):]) for r in ids]
        drafts, _ = calls.run("draft", draft.draft, ids, committed, a.k)
        for r in ids:
            known[r] = len(prompts[r]) + len(sd[r])
        for r, o in zip(ids, calls.run("verify", target.verify, ids, drafts, None)):
            sd[r] += o.token_ids
            accepted.append(o.num_accepted)
    for rid in prompts:
        target.release(rid), draft.release(rid)
    return sd, accepted


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    from specdec.vllm_backend.draft import VllmDraftWorker
    from specdec.vllm_backend.engine import VllmEngineConfig
    from specdec.vllm_backend.models import resolve_vllm_model
    from specdec.vllm_backend.target import VllmTargetWorker

    share = 0.25 if a.ar_decode_steps else 0.3
    common = dict(device=a.device, dtype=a.dtype, max_num_seqs=a.num_requests, max_model_len=a.max_model_len,
                  enforce_eager=a.enforce_eager, gpu_memory_utilization=share)
    target_dir, fmt = resolve_vllm_model(a.target)
    draft_dir, draft_fmt = resolve_vllm_model(a.draft, target_dir)
    t0 = time.perf_counter()
    is_async = a.device == "cuda"
    target = VllmTargetWorker(VllmEngineConfig(model=target_dir, load_format=fmt, num_speculative_tokens=a.k, **common))
    allow_another_capture()
    draft = VllmDraftWorker(VllmEngineConfig(model=draft_dir, load_format=draft_fmt, **common))
    build_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 1000) for _ in range(a.prompt_len or 8 + 5 * i)] for i in range(a.num_requests)}
    calls = _Calls(("draft", "verify") if a.profile_out else ())
    ar = _decode_all(target, prompts, a.num_tokens, calls, "verify_k0")
    sd, accepted = _sd(target, draft, prompts, a, calls)
    n = a.num_tokens + 1
    result = {"build_s": round(build_s, 1), "sd_equals_ar": all(sd[r][:n] == ar[r][:n] for r in prompts),
              "mean_accepted_per_step": sum(accepted) / len(accepted)}
    if a.profile_out:   # before the ar part: its tables survive a failure there
        calls.write(a.profile_out)
    print("SMOKE_SD", json.dumps({**result, **{f"{k}_ms_mean": sum(v) / len(v) for k, v in calls.ms.items()}}),
          flush=True)
    if a.ar_decode_steps:
        allow_another_capture()
        ar_engine = VllmTargetWorker(VllmEngineConfig(model=target_dir, load_format=fmt, async_scheduling=is_async, **common))
        one = _decode_all(ar_engine, prompts, a.num_tokens, calls, "ar_1step")
        many = _decode_all(ar_engine, prompts, a.num_tokens, calls, "ar_multistep", a.ar_decode_steps)
        result["ar_multistep_equals_1step"] = all(many[r][:n] == one[r][:n] == ar[r][:n] for r in prompts)
        result["ar_ms_per_token_1step"] = sum(calls.ms["ar_1step"]) / len(calls.ms["ar_1step"])
        result["ar_ms_per_token_multistep"] = sum(calls.ms["ar_multistep"]) / len(calls.ms["ar_multistep"]) / a.ar_decode_steps
    for name, values in calls.ms.items():
        result[f"{name}_ms_mean"] = sum(values) / len(values)
    print("SMOKE", json.dumps(result), flush=True)
    ok = result["sd_equals_ar"] and result.get("ar_multistep_equals_1step", True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
