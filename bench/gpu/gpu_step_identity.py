"""Greedy identity on the GPU for ``bench/gpu/gpu_step.py``: ``ar`` vs ``sd``/``psd`` outputs through
``reference.loop`` with CUDA graphs on (random weights)."""

from __future__ import annotations

import random

import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.engine.runner import ModelRunner


def greedy_identity(args, device: torch.device) -> dict:
    """ar vs sd vs psd greedy outputs through reference.loop, graphs on (random weights).

    Two drafts: the target's own weights in bfloat16 (most drafts accepted, some rejected) and
    another seed (almost all rejected), so both the accept and the reject paths are checked.
    """
    cache = CacheConfig(max_num_seqs=8, max_model_len=args.max_model_len)
    spec = args.identity_model
    target = ModelRunner(ModelConfig(model=spec, dtype="float32", device=str(device)), cache)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, target.input_vocab_size) for _ in range(rng.randint(8, 64))]
               for _ in range(args.identity_requests)]
    reference, _ = _run_loop("ar", target, None, prompts, args)
    drafts = {f"{spec} in bfloat16": ModelConfig(model=spec, dtype="bfloat16", device=str(device)),
              f"{spec}:1 (other seed)": ModelConfig(model=f"{spec}:1", dtype="float32",
                                                    device=str(device))}
    runs = []
    for name, draft_cfg in drafts.items():
        draft = ModelRunner(draft_cfg, cache)
        for mode in ("sd", "psd"):
            outputs, stats = _run_loop(mode, target, draft, prompts, args)
            mismatched = [i for i, (a, b) in enumerate(zip(reference, outputs)) if a != b]
            runs.append(dict(draft=name, mode=mode, mismatched_requests=mismatched, **stats))
        del draft
    return dict(target=spec, weights="random weights", target_dtype="float32",
                num_requests=len(prompts), max_tokens=args.max_tokens, k=args.k,
                graphs=target.static_stepper is not None and target.static_stepper.use_graphs,
                runs=runs, is_equal=all(not r["mismatched_requests"] for r in runs))


def _run_loop(mode: str, target: ModelRunner, draft: ModelRunner | None,
              prompts: list[list[int]], args) -> tuple[list[list[int]], dict]:
    """Greedy outputs of one ``reference.loop.ReferenceLoop`` run, and its stats."""
    from reference.loop import LoopConfig, ReferenceLoop, Request
    from specdec.sample.sampling import SamplingParams
    from specdec.engine.worker import DraftWorker, TargetWorker

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    requests = [Request(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    loop = ReferenceLoop(LoopConfig(mode, args.k, 8), TargetWorker(target, seed=0),
                         None if draft is None else DraftWorker(draft, seed=0))
    stats = loop.run(requests)
    return [r.output_token_ids for r in requests], dict(
        output_tokens_per_s=stats.output_tokens_per_s,
        mean_acceptance_length=stats.mean_acceptance_length)
