"""Does a draft know the target or its training prompts? (issue 4 diagnostic)

Teacher-forced greedy top-1 agreement between draft and target (``beta`` of
``bench/draft/draft_acceptance.py`` at T=0) over the target's greedy answers to two prompt sets of equal
size: prompts the distillation trained on (``distill.data.load_prompts``, shuffled with
``--seed``) and unseen Spec-Bench multi-turn prompts (MT-Bench's first turns, excluded from
training). A large gap means the draft learned its training prompts rather than the target.
Several ``--draft`` dirs are scored on the same trajectories. Prints and writes JSON.

Usage: ``python bench/draft/draft_generalization.py --draft drafts/smollm2-135m-instruct [other dirs]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.draft.draft_acceptance import MULTI_TURN, RESULTS_DIR, load_prompts, pair_betas, trajectories  # noqa: E402
from specdec.config import ModelConfig  # noqa: E402
from distill.config import DEFAULT_DATA_DIR  # noqa: E402
from distill.data import EVAL_FILE, encode_prompts  # noqa: E402
from distill.data import load_prompts as training_prompts  # noqa: E402
from specdec.models.draft_format import load_draft, read_meta, resolve_target_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", nargs="+", default=["drafts/smollm2-135m-instruct"])
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "draft_generalization.json"))
    args = ap.parse_args(argv)
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    target_dir = resolve_target_dir(read_meta(args.draft[0]), args.draft[0])
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    train = training_prompts(args.data_dir)
    random.Random(args.seed).shuffle(train)
    sets = {"training_chat": encode_prompts(tokenizer, train, 512)[:args.num_prompts],
            "spec_bench_multi_turn": load_prompts(tokenizer, os.path.join(args.data_dir, EVAL_FILE),
                                                  args.num_prompts, 768).get(MULTI_TURN, [])}
    for name, ps in sets.items():
        if not ps:
            raise SystemExit(f"no {name} prompts under --data-dir {args.data_dir}")
    pairs = {name: trajectories(target, ps, 0.0, args.max_new_tokens, tokenizer.eos_token_id, args.seed)
             for name, ps in sets.items()}
    res = {"method": __doc__.split("\n\n")[1], "num_prompts": args.num_prompts,
           "max_new_tokens": args.max_new_tokens, "agreement": {}}
    for path in args.draft:
        draft = load_draft(path, ModelConfig(model=path), target_model=target)
        res["agreement"][path] = {name: float(torch.cat(pair_betas(target, draft, p, 0.0)).mean())
                                  for name, p in pairs.items()}
        print(path, res["agreement"][path], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
