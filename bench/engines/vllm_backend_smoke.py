"""``python -m bench.engines.vllm_backend_smoke``: the vLLM backend's workers in one process, greedy sd = ar.

Builds ``VllmTargetWorker`` (speculation k) and ``VllmDraftWorker`` for the given models, decodes
``--num-requests`` prompts of random token ids greedily without drafts (ar), then again with
``--k`` drafts per step from the draft worker (sd), and prints whether every sd output equals
its ar output, the accepted tokens per step and the mean verify / draft call times (ms).
A quick check of the backend on a new machine (GPU or CPU) before a benchmark.

    python -m bench.engines.vllm_backend_smoke --device cuda --target random:smollm2-135m --draft random:smollm2-135m
"""
from __future__ import annotations

import argparse
import json
import random
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engines.vllm_backend_smoke")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--num-tokens", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true")
    a = p.parse_args(argv)
    from specdec.sample.sampling import SamplingParams
    from specdec.vllm_backend.draft import VllmDraftWorker
    from specdec.vllm_backend.engine import VllmEngineConfig
    from specdec.vllm_backend.models import resolve_vllm_model
    from specdec.vllm_backend.target import VllmTargetWorker

    common = dict(device=a.device, dtype=a.dtype, max_num_seqs=a.num_requests, max_model_len=512,
                  enforce_eager=a.enforce_eager, gpu_memory_utilization=0.3)
    target_dir, fmt = resolve_vllm_model(a.target)
    draft_dir, draft_fmt = resolve_vllm_model(a.draft, target_dir)
    t0 = time.perf_counter()
    target = VllmTargetWorker(VllmEngineConfig(model=target_dir, load_format=fmt, num_speculative_tokens=a.k, **common))
    draft = VllmDraftWorker(VllmEngineConfig(model=draft_dir, load_format=draft_fmt, **common))
    build_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 1000) for _ in range(8 + 5 * i)] for i in range(a.num_requests)}
    greedy = SamplingParams(temperature=0.0, seed=0)
    ar = {rid: [o.token_ids[0]] for rid, o in zip(prompts, target.add_requests([(r, p, greedy) for r, p in prompts.items()]))}
    for _ in range(a.num_tokens):
        for rid, o in zip(prompts, target.verify(list(prompts), [[] for _ in prompts], None)):
            ar[rid] += o.token_ids
    for rid in prompts:
        target.release(rid)
    sd = {rid: [o.token_ids[0]] for rid, o in zip(prompts, target.add_requests([(r, p, greedy) for r, p in prompts.items()]))}
    draft.add_requests([(r, p, greedy) for r, p in prompts.items()])
    known = {rid: len(p) for rid, p in prompts.items()}
    accepted, verify_ms, draft_ms = [], [], []
    while min(len(v) for v in sd.values()) < a.num_tokens + 1:
        ids = list(prompts)
        committed = [(known[r], sd[r][known[r] - len(prompts[r]):]) for r in ids]
        t = time.perf_counter()
        drafts, _ = draft.draft(ids, committed, a.k)
        draft_ms.append((time.perf_counter() - t) * 1e3)
        for r in ids:
            known[r] = len(prompts[r]) + len(sd[r])
        t = time.perf_counter()
        outs = target.verify(ids, drafts, None)
        verify_ms.append((time.perf_counter() - t) * 1e3)
        for r, o in zip(ids, outs):
            sd[r] += o.token_ids
            accepted.append(o.num_accepted)
    n = a.num_tokens + 1
    result = {"build_s": round(build_s, 1), "sd_equals_ar": all(sd[r][:n] == ar[r][:n] for r in prompts),
              "mean_accepted_per_step": sum(accepted) / len(accepted),
              "verify_ms_mean": sum(verify_ms) / len(verify_ms), "draft_ms_mean": sum(draft_ms) / len(draft_ms)}
    print("SMOKE", json.dumps(result), flush=True)
    return 0 if result["sd_equals_ar"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
