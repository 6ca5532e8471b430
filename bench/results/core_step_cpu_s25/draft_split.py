# The throwaway timing script behind README.md's drafter rows (PYTHONPATH=<tree> .venv-vllm/bin/python bench/results/core_step_cpu_s25/draft_split.py).
import time, random
from specdec.vllm_backend.engine import VllmEngineConfig
from specdec.vllm_backend.models import resolve_vllm_model
from specdec.vllm_backend.draft import VllmDraftWorker
from specdec.sample.sampling import SamplingParams
d, fmt = resolve_vllm_model("random:tiny-llama-hd64")
w = VllmDraftWorker(VllmEngineConfig(model=d, load_format=fmt, device="cpu", dtype="float32", max_num_seqs=64,
                                     max_model_len=1024, enforce_eager=True, kv_cache_space_gib=1))
T = {"abort": 0.0, "n": 0}
op = w.engine.output_processor; po = op.process_outputs
P = {"t": 0.0}
def tpo(*a, **k):
    t = time.perf_counter(); r = po(*a, **k); P["t"] += time.perf_counter() - t; return r
op.process_outputs = tpo
orig = w.engine.abort_request
def timed(ids, internal=False):
    t = time.perf_counter(); r = orig(ids, internal=internal); T["abort"] += time.perf_counter() - t; T["n"] += 1; return r
w.engine.abort_request = timed
rng = random.Random(0)
seqs = {f"r{i}": [rng.randrange(3, 1000) for _ in range(150)] for i in range(32)}
g = SamplingParams(temperature=0.0, seed=0)
w.add_requests([(r, p, g) for r, p in seqs.items()])
T["abort"], T["n"] = 0.0, 0; P["t"] = 0.0
t0 = time.perf_counter()
for c in range(20):
    committed = []
    for rid in seqs:
        start = len(seqs[rid]); seqs[rid] += [rng.randrange(3, 1000) for _ in range(3)]; committed.append((start, seqs[rid][start:]))
    w.draft(list(seqs), committed, 4)
wall = time.perf_counter() - t0
print("ms per call", wall * 1e3 / 20, "output processor ms per call", P["t"] * 1e3 / 20, "abort ms per call", T["abort"] * 1e3 / max(T["n"], 1), T["n"])
