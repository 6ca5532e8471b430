"""Verifier TP = 2 (torchrun, NCCL, one GPU a rank) against TP = 1: same greedy and seeded
sampled tokens, target logprobs (log-softmax of the logits) and top-5 logprobs within tolerance.

Three steps, one command each (``bench/gpu/gpu_dataplane.py`` documents the device run):
  python bench/gpu/gpu_dataplane_tp.py save DIR                  # random-weight Llama-8B-shaped target
  python bench/gpu/gpu_dataplane_tp.py run DIR OUT.json          # TP = 1 (plain) ...
  torchrun --nproc-per-node 2 bench/gpu/gpu_dataplane_tp.py run DIR OUT.json   # ... or TP = 2
  python bench/gpu/gpu_dataplane_tp.py compare TP1.json TP2.json RESULT.json
``run`` builds the engine exactly as ``python -m verifier_svc`` does (``load_engine``: tp_plan
"auto" sharding, ``CommandChannel`` broadcasts incl. draft probs over NCCL on GPU) and drives
``VerifierEngine`` directly (no gRPC server): add 4 greedy + 1 seeded sampled request, 3 verify
steps of k = 3 random drafts with draft probs, one decode step. float32 compute.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PRESET = "llama-8b"
NUM_LAYERS = 2  # Llama-3.1-8B widths (32 heads, 8 KV heads, V = 128256), 2 of its 32 layers
NUM_REQUESTS, SAMPLED_ID, K, NUM_STEPS, PROMPT_LEN, NUM_TOP = 4, "sampled", 3, 3, 64, 5
LOGPROB_ATOL = 1e-3


def save(model_dir: str) -> None:
    from bench.gpu.gpu_dataplane_models import build_random_llama

    model = build_random_llama(PRESET, "cuda:0" if torch.cuda.is_available() else "cpu", torch.bfloat16, NUM_LAYERS)
    model.save_pretrained(model_dir)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params to {model_dir}", flush=True)


def _requests(vocab: int):
    from minedraft.v1 import common_pb2, engine_pb2

    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(NUM_REQUESTS + 1):
        rid = SAMPLED_ID if i == NUM_REQUESTS else f"g{i}"
        sampling = common_pb2.SamplingParams(temperature=0.8 if rid == SAMPLED_ID else 0.0, logprobs=NUM_TOP,
                                             max_tokens=64)
        if rid == SAMPLED_ID:
            sampling.seed = 7
        seqs.append(engine_pb2.SeqInit(request_id=rid, sampling=sampling,
                                       prompt_token_ids=torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()))
    return engine_pb2.AddRequestsRequest(seqs=seqs), gen


def _outputs(outputs) -> list[dict]:
    return [{"id": o.request_id, "tokens": list(o.token_ids), "logprobs": list(o.logprobs),
             "top": [list(t.logprobs) for t in o.top_logprobs]} for o in outputs]


def run(model_dir: str, out_path: str) -> None:
    from minedraft.v1 import engine_pb2
    from engine_svc.tensor_proto import tensor_to_proto
    from verifier_svc.__main__ import load_engine, parse_args
    from verifier_svc.tp import TPContext

    ctx = TPContext.from_env()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # under TP: cuda:<local rank>
    args = parse_args(["--model", model_dir, "--device", device, "--dtype", "float32",
                       "--max-num-seqs", str(NUM_REQUESTS + 1), "--max-model-len", "256", "--seed", "0"])
    engine = load_engine(args, ctx)
    if not ctx.is_driver:
        engine.follow()
        return
    add, gen = _requests(engine.vocab_size)
    ids = [s.request_id for s in add.seqs]
    results = [_outputs(engine.add(add).outputs)]
    for step in range(NUM_STEPS + 1):
        k = K if step < NUM_STEPS else 0
        request = engine_pb2.VerifyRequest(step_id=step, request_ids=ids, data_plane=engine_pb2.DATA_PLANE_INLINE)
        if k:
            drafts = torch.randint(3, engine.vocab_size, (len(ids), k), generator=gen, dtype=torch.int32)
            probs = torch.softmax(torch.randn(len(ids), k, engine.vocab_size, generator=gen) * 4, -1)
            request.draft_token_ids.CopyFrom(tensor_to_proto(drafts))
            request.draft_probs.CopyFrom(tensor_to_proto(probs))
            request.has_draft_probs = True
        results.append(_outputs(engine.verify(request, engine_pb2.DATA_PLANE_INLINE).outputs))
    engine.shutdown()
    with open(out_path, "w") as handle:
        text = engine.worker.runner.model.config.get_text_config()
        shape = {name: getattr(text, name) for name in ("hidden_size", "num_hidden_layers", "vocab_size")}
        json.dump({"tensor_parallel_size": ctx.world_size, "model": shape, "steps": results}, handle)
    print(f"TP={ctx.world_size}: wrote {out_path}", flush=True)


def compare(tp1_path: str, tp2_path: str, out_path: str) -> dict:
    """{tokens_equal, max_abs_logprob_diff, max_abs_top_logprob_diff, ...}; also written to ``out_path``."""
    with open(tp1_path) as a, open(tp2_path) as b:
        tp1, tp2 = json.load(a), json.load(b)
    tokens_equal, lp_diff, top_diff, num_tokens = True, 0.0, 0.0, 0
    for step1, step2 in zip(tp1["steps"], tp2["steps"], strict=True):
        for o1, o2 in zip(step1, step2, strict=True):
            tokens_equal &= o1["tokens"] == o2["tokens"]
            num_tokens += len(o1["tokens"])
            if o1["tokens"] == o2["tokens"]:
                lp_diff = max([lp_diff, *(abs(x - y) for x, y in zip(o1["logprobs"], o2["logprobs"]))])
                for t1, t2 in zip(o1["top"], o2["top"]):
                    top_diff = max([top_diff, *(abs(x - y) for x, y in zip(t1, t2))])
    result = {"model": tp1.get("model"), "dtype": "float32", "tp_sizes": [tp1["tensor_parallel_size"], tp2["tensor_parallel_size"]],
              "num_tokens_compared": num_tokens, "tokens_equal": tokens_equal,
              "max_abs_logprob_diff": lp_diff, "max_abs_top_logprob_diff": top_diff, "atol": LOGPROB_ATOL,
              "passed": tokens_equal and max(lp_diff, top_diff) <= LOGPROB_ATOL}
    with open(out_path, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str]) -> None:
    commands = {"save": (save, 1), "run": (run, 2), "compare": (compare, 3)}
    if not argv or argv[0] not in commands or len(argv) - 1 != commands[argv[0]][1]:
        sys.exit(__doc__)
    commands[argv[0]][0](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
