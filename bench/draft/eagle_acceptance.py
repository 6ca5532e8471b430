"""Spec-Bench acceptance of an EAGLE-style draft head (``distill.eagle``), issue 4.

Same prompts, trajectories and reporting as ``bench/draft/draft_acceptance.py`` (16 prompts per
category, first turn, target-generated trajectories of ``--max-new-tokens``), but the draft is
chained exactly as it would be served: after ``m`` committed tokens the head sees the target's
features of positions ``0..m-2`` and drafts k tokens, each step fed its own predicted feature.

- T = 0: exact greedy SD along the target's greedy trajectory: a step at ``m`` accepts the
  leading draft tokens equal to the trajectory (then the target's own token is committed).
- T = 1: along a sampled target trajectory, draft step u of the chain at ``m`` is accepted with
  probability ``beta = sum_v min(p(v), q(v))`` (Leviathan et al. 2023, Def. 3.1), ``--num-trials``
  Monte Carlo walks; like draft_acceptance.py's T = 1 figure, it approximates the prefix after an
  accepted token by the target's own sample.

Mean acceptance length = committed tokens per step (accepted + 1); per-position acceptance rate
= share of steps whose i-th draft token is accepted. Writes ``<out-name>.{json,md}``.

Usage: ``python -m bench.draft.eagle_acceptance --head <dir> --target-dir <HF dir> --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.draft.draft_acceptance import MAX_K, RESULTS_DIR, SPEC_BENCH, load_prompts, trajectories
from distill.data import pad_batch
from distill.eagle import target_features, unrolled_logits
from distill.eagle_train import load_head


@torch.no_grad()
def chain_acceptance(head, target, pairs, temperature: float, feature_layers, chunk: int = 8) -> list[torch.Tensor]:
    """Per sequence: [MAX_K, n - 1] acceptance of chain p's step u (row u-1): 0/1 at T=0, beta at T=1."""
    out = []
    for start in range(0, len(pairs), chunk):
        batch = pairs[start:start + chunk]
        ids, mask, _ = pad_batch(batch, target.device)
        feats, final = target_features(target, ids, mask, feature_layers)
        steps = unrolled_logits(head, feats, ids, mask[:, 1:].bool(), MAX_K)
        width = ids.shape[1]
        for i, (p, r) in enumerate(batch):
            n = len(p) + len(r)
            acc = torch.zeros(MAX_K, width - 1, device=ids.device)
            for u, logits in enumerate(steps, start=1):
                rows = max(0, n - 1 - u)                       # chains p whose step-u token t_{p+u+1} exists
                q_logits = logits[i, :rows]
                if temperature == 0:
                    truth = ids[i, u + 1:u + 1 + rows]
                    acc[u - 1, :rows] = (head.vocab_ids[q_logits.argmax(-1)] == truth).float()
                else:
                    p_probs = torch.softmax(target.lm_head(final[i, u:u + rows]).float() / temperature, -1)
                    q = torch.softmax(q_logits.float() / temperature, -1)
                    acc[u - 1, :rows] = torch.minimum(p_probs[:, head.vocab_ids], q).sum(-1).clamp(0, 1)
            out.append(acc[:, :n - 1].cpu())
    return out


def walk(acc: torch.Tensor, prompt_len: int, k: int, gen: torch.Generator, num_trials: int) -> tuple[list[int], list[int]]:
    """Simulated SD steps over one sequence: accepted counts per step, per-position accept counts."""
    n = acc.shape[1] + 1
    steps, per_pos = [], [0] * k
    for _ in range(num_trials):
        m = prompt_len + 1                                     # the prompt plus the prefill's token
        while m < n:
            p, num_draft = m - 2, min(k, n - m)
            a = 0
            while a < num_draft and torch.rand(1, generator=gen).item() < acc[a, p].item():
                per_pos[a] += 1
                a += 1
            steps.append(a)
            m += a + 1
    return steps, per_pos


def table(accs: dict[str, list[tuple[int, torch.Tensor]]], num_trials: int, seed: int) -> dict:
    """category (and ``all``) -> k -> mean acceptance length, per-position rates, steps."""
    res = {}
    cats = dict(accs, all=[x for v in accs.values() for x in v])
    for cat, items in cats.items():
        res[cat] = {}
        for k in range(1, MAX_K + 1):
            gen, steps, per_pos = torch.Generator().manual_seed(seed + k), [], [0] * k
            for prompt_len, acc in items:
                s, pp = walk(acc, prompt_len, k, gen, num_trials)
                steps += s
                per_pos = [x + y for x, y in zip(per_pos, pp)]
            res[cat][k] = {"mean_acceptance_length": 1 + sum(steps) / max(len(steps), 1),
                           "acceptance_rate_per_pos": [x / max(len(steps), 1) for x in per_pos],
                           "num_steps": len(steps)}
    return res


def write_markdown(res: dict, path: str) -> None:
    """Mean acceptance length per category and k, per temperature."""
    lines = [f"# EAGLE head acceptance on Spec-Bench ({res['head']})", ""]
    for temp, cats in res["acceptance"].items():
        lines += [f"## T = {temp}", "", "| category | " + " | ".join(f"k={k}" for k in range(1, MAX_K + 1)) + " |",
                  "|---|" + "---|" * MAX_K]
        for cat, by_k in cats.items():
            lines.append(f"| {cat} | " + " | ".join(f"{by_k[k]['mean_acceptance_length']:.2f}"
                                                     for k in range(1, MAX_K + 1)) + " |")
        rates = cats["all"][4]["acceptance_rate_per_pos"]
        lines += ["", "per-position acceptance rate at k=4 (all): " + ", ".join(f"{r:.3f}" for r in rates), ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="dir written by distill.eagle_train")
    ap.add_argument("--target-dir", required=True, help="HF dir of the target")
    ap.add_argument("--spec-bench", default=SPEC_BENCH)
    ap.add_argument("--num-per-category", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-trials", type=int, default=20)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    ap.add_argument("--out-name", default="eagle_acceptance")
    args = ap.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target_dir)
    target = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).to(args.device).eval()
    head = load_head(args.head, target)
    with open(os.path.join(args.head, "eagle.json"), encoding="utf-8") as f:
        feature_layers = tuple(json.load(f).get("feature_layers", [-1]))
    prompts = load_prompts(tokenizer, args.spec_bench, args.num_per_category, args.max_prompt_tokens)
    res = {"head": args.head, "args": vars(args), "acceptance": {}}
    for temp in map(float, args.temperatures.split(",")):
        accs = {}
        for cat, ps in prompts.items():
            pairs = trajectories(target, ps, temp, args.max_new_tokens, tokenizer.eos_token_id, args.seed)
            accs[cat] = [(len(p), a) for (p, _), a in zip(pairs, chain_acceptance(head, target, pairs, temp, feature_layers))]
        res["acceptance"][str(temp)] = table(accs, 1 if temp == 0 else args.num_trials, args.seed)
        print(temp, {c: round(v[4]["mean_acceptance_length"], 3) for c, v in res["acceptance"][str(temp)].items()})
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, args.out_name + ".json"), "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, os.path.join(args.results_dir, args.out_name + ".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
