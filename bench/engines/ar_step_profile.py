"""``python -m bench.engines.ar_step_profile``: where a plain decode step of ours `ar` goes,
against vLLM's own step loop on the same engine.

One in-process vLLM engine (``specdec.vllm_backend.engine.build_engine``, async scheduling on
cuda) decodes ``b`` requests of random prompt ids greedily, ``--num-tokens`` tokens each, for
each batch size b of ``--batch-sizes``, in these loops:

- ``vllm``: vLLM's own loop, ``LLMEngine.add_request`` then ``step()`` until every request
  finished, the PSD filter off (``PsdScheduler.set_step(None)``: vLLM's scheduler as is), no
  logprobs (what vLLM's OpenAI server computes for a client that asks none);
- ``vllm_logprob``: the same with the sampled token's logprob (``logprobs=0``);
- ``vllm_core``: vLLM's engine core alone, ``engine_core.get_output()`` until every request
  finished, without the output processor: what the engine process of vLLM's OpenAI server runs
  (its API server process turns the outputs into responses beside it), no logprobs. ``vllm`` -
  ``vllm_core`` is that processing's share of a step where the host, not the GPU, bounds it;
  ours reads the engine core directly too (``specdec.vllm_backend.outputs.core_step``);
- ``ours``: ``VllmTargetWorker.decode`` over the same engine, ``--decode-steps`` tokens per
  call, sampled-token logprobs on (what the verifier's ``ar`` asks today);
- ``ours_no_logprob``: the same with ``SamplingParams.logprobs = -1`` (none).

Per loop it reports ms per decode step (the wall from every request's first token to the end,
over the steps; prefill excluded) and, from one cProfile of a second pass, the share of that
wall the engine thread spent blocked on the GPU's result (``Future.result``: the step's GPU
time not hidden behind the CPU's; near 1 means the GPU is the bottleneck, lower means the CPU
leaves the GPU idle). Results: ``--out`` JSON (and the cProfile tables beside it).

    python -m bench.engines.ar_step_profile --device cuda --target random:llama-8b --batch-sizes 1,16,64 \\
        --out /tmp/ar_profile.json
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

LOOPS = ("vllm", "vllm_logprob", "vllm_core", "ours", "ours_no_logprob")
# builtins in which the engine thread blocks on the GPU (an event's or stream's synchronize, a
# future's lock, a device-to-host copy): their own time is the step's GPU time not hidden by the CPU
WAIT_BUILTINS = ("synchronize", "'acquire' of '_thread.lock'", "'tolist' of", "'item' of", "'cpu' of")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.engines.ar_step_profile")
    p.add_argument("--target", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--num-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", required=True, help="results JSON (cProfile tables go beside it)")
    a = p.parse_args(argv)
    a.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    a.loops = [name for name in a.loops.split(",") if name]
    unknown = sorted(set(a.loops) - set(LOOPS))
    if unknown:
        p.error(f"--loops: unknown {unknown}, known {list(LOOPS)}")
    if a.num_tokens % a.decode_steps:
        p.error("--num-tokens must be a multiple of --decode-steps")
    return a


def _prompts(b: int, n: int, tag: str) -> dict[str, list[int]]:
    rng = random.Random(b)
    return {f"{tag}{i}": [rng.randrange(3, 1000) for _ in range(n)] for i in range(b)}


def _vllm_loop(engine, prompts, num_tokens: int, with_logprob: bool, core_only: bool = False) -> tuple[float, dict]:
    """vLLM's own loop: ms per step after every request's first token, and the outputs. With
    ``core_only`` (``vllm_core``) each step is read from the engine core (``core_step``), and the
    states the output processor then keeps are aborted at the end, which frees them there."""
    from specdec.sample.sampling import NO_LOGPROBS, SamplingParams
    from specdec.vllm_backend.engine import drain, scheduler_of, to_vllm_sampling
    from specdec.vllm_backend.outputs import collect_step, core_step
    from specdec.vllm_backend.scheduler import PsdStep

    scheduler_of(engine).set_step(None)
    for rid, prompt in prompts.items():   # one params object per request (to_vllm_sampling's skip_clone)
        params = to_vllm_sampling(SamplingParams(temperature=0.0, seed=0), num_tokens + 1, with_logprobs=with_logprob)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    names = {iid: (state.external_req_id, NO_LOGPROBS) for iid, state in engine.output_processor.request_states.items()
             if state.external_req_id in prompts}
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    pending, t_first = set(prompts), None
    while pending:
        for rid, delta in (core_step(engine, names) if core_only else collect_step(engine.step())).items():
            out[rid] += delta.token_ids
            if delta.finish_reason is not None:
                pending.discard(rid)
        if t_first is None and all(out.values()):
            t_first = time.perf_counter()
    wall = time.perf_counter() - t_first
    if core_only:
        engine.abort_request(list(prompts))
        if any(state.external_req_id in prompts for state in engine.output_processor.request_states.values()):
            raise RuntimeError("vllm_core: the output processor kept requests after their abort")
    drain(engine)
    scheduler_of(engine).set_step(PsdStep(frozenset()))   # back to the worker's rule: nothing runs between calls
    return wall * 1e3 / num_tokens, out


def _ours_loop(worker, prompts, num_tokens: int, steps: int, logprobs: int) -> tuple[float, dict]:
    from specdec.sample.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, seed=0, logprobs=logprobs)
    firsts = worker.add_requests([(rid, p, greedy) for rid, p in prompts.items()])
    out = {rid: list(o.token_ids) for rid, o in zip(prompts, firsts)}
    t0 = time.perf_counter()
    for _ in range(num_tokens // steps):
        for rid, o in zip(prompts, worker.decode(list(prompts), steps)):
            out[rid] += o.token_ids
    wall = time.perf_counter() - t0
    for rid in prompts:
        worker.release(rid)
    return wall * 1e3 / num_tokens, out


def _wait_share(profile: cProfile.Profile, wall_s: float) -> float:
    """Share of ``wall_s`` the engine thread spent blocked on the GPU (``WAIT_BUILTINS``' own time)."""
    stats = pstats.Stats(profile)
    waited = sum(tt for (file, _, name), (_, _, tt, _, _) in stats.stats.items()
                 if file == "~" and any(w in name for w in WAIT_BUILTINS))
    return waited / wall_s if wall_s else 0.0


def _run_loop(name, engine, worker, b, a) -> tuple[float, dict]:
    prompts = _prompts(b, a.prompt_len, f"{name}-{b}-")
    if name.startswith("vllm"):
        return _vllm_loop(engine, prompts, a.num_tokens, name == "vllm_logprob", core_only=name == "vllm_core")
    return _ours_loop(worker, prompts, a.num_tokens, a.decode_steps, -1 if name == "ours_no_logprob" else 0)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    from specdec.vllm_backend.engine import VllmEngineConfig, build_engine
    from specdec.vllm_backend.models import resolve_vllm_model
    from specdec.vllm_backend.target import VllmTargetWorker

    target_dir, fmt = resolve_vllm_model(a.target)
    cfg = VllmEngineConfig(model=target_dir, load_format=fmt, device=a.device, dtype=a.dtype,
                           max_num_seqs=max(a.batch_sizes), max_model_len=a.max_model_len,
                           enforce_eager=a.enforce_eager, gpu_memory_utilization=a.gpu_memory_utilization,
                           async_scheduling=a.device == "cuda")
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    worker = VllmTargetWorker(cfg, engine=engine)
    result = {"target": a.target, "device": a.device, "build_s": round(time.perf_counter() - t0, 1),
              "num_tokens": a.num_tokens, "decode_steps": a.decode_steps, "async_scheduling": cfg.async_scheduling,
              "points": []}
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    for b in a.batch_sizes:
        outputs = {}
        for name in a.loops:
            _run_loop(name, engine, worker, b, a)   # warm-up pass (graphs, allocator)
            ms, outputs[name] = _run_loop(name, engine, worker, b, a)
            profile = cProfile.Profile()
            t = time.perf_counter()
            profile.runcall(_run_loop, name, engine, worker, b, a)
            wall = time.perf_counter() - t
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            with open(os.path.join(out_dir, f"ar_profile_{name}_b{b}.txt"), "w") as f:
                f.write(text.getvalue())
            point = {"batch_size": b, "loop": name, "ms_per_step": round(ms, 3),
                     "gpu_wait_share": round(_wait_share(profile, wall), 3)}
            result["points"].append(point)
            print("AR_PROFILE", json.dumps(point), flush=True)
        tokens = [list(outputs[name].values()) for name in a.loops]   # each in prompt order
        result.setdefault("greedy_equal", {})[str(b)] = all(t == tokens[0] for t in tokens)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("AR_PROFILE_DONE", json.dumps({"greedy_equal": result["greedy_equal"], "build_s": result["build_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
