# The throwaway timing script behind README.md (run with .venv-vllm/bin/python from the repository root).
"""Per decode step: time inside the engine core (EngineCore.step via the in-process client) vs
the rest of ours' loop (vLLM's output processor + our per-step code), tiny model, CPU."""
import time, random, sys, json
from specdec.vllm_backend.engine import VllmEngineConfig, build_engine
from specdec.vllm_backend.models import resolve_vllm_model
from specdec.vllm_backend.target import VllmTargetWorker
from specdec.sample.sampling import SamplingParams

target_dir, fmt = resolve_vllm_model("random:tiny-llama-hd64")
cfg = VllmEngineConfig(model=target_dir, load_format=fmt, device="cpu", dtype="float32", max_num_seqs=64,
                       max_model_len=1024, enforce_eager=True)
engine = build_engine(cfg)
worker = VllmTargetWorker(cfg, engine=engine)
T = {"core": 0.0, "outproc": 0.0, "n": 0}
client = engine.engine_core
orig_get = client.get_output
def timed_get(*a, **k):
    t = time.perf_counter(); r = orig_get(*a, **k); T["core"] += time.perf_counter() - t; T["n"] += 1; return r
client.get_output = timed_get
op = engine.output_processor
orig_po = op.process_outputs
def timed_po(*a, **k):
    t = time.perf_counter(); r = orig_po(*a, **k); T["outproc"] += time.perf_counter() - t; return r
op.process_outputs = timed_po
for b in (16, 64):
    for rep in range(3):
        rng = random.Random(b)
        prompts = {f"r{b}-{rep}-{i}": [rng.randrange(3, 1000) for _ in range(64)] for i in range(b)}
        g = SamplingParams(temperature=0.0, seed=0, logprobs=-1)
        worker.add_requests([(rid, p, g) for rid, p in prompts.items()])
        for k in T: T[k] = 0 if k == "n" else 0.0
        t0 = time.perf_counter()
        for _ in range(3):
            worker.decode(list(prompts), 32)
        wall = time.perf_counter() - t0
        for rid in prompts: worker.release(rid)
        n = T["n"]
        print(json.dumps({"b": b, "steps": n, "wall_ms_per_step": round(wall * 1e3 / n, 3),
              "core_ms": round(T["core"] * 1e3 / n, 3), "outproc_ms": round(T["outproc"] * 1e3 / n, 3),
              "rest_ms": round((wall - T["core"] - T["outproc"]) * 1e3 / n, 3)}), flush=True)
