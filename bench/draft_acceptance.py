"""Draft-model acceptance and cost on Spec-Bench (issue 4). Writes JSON + Markdown to bench/results/.

Method (plain HF forwards, no serving stack):

- Prompts: Spec-Bench ``question.jsonl``, first turn, chat template; the multi-turn categories
  (MT-Bench's writing, roleplay, ...) form the category ``multi_turn``, the others keep their name
  (translation, summarization, qa, math_reasoning, rag). First ``--num-per-category`` prompts of
  at most ``--max-prompt-tokens`` tokens per category.
- Trajectory: the TARGET generates up to ``--max-new-tokens`` tokens (greedy at T=0, sampled at
  T=1; batched per category, left-padded; stops at EOS).
  Speculative decoding is lossless, so this is distributed as SD's own output.
- Per-position acceptance probability ``beta_j`` along the trajectory, both models teacher-forced
  on it: T=0: ``beta_j = 1[argmax q_j == argmax p_j]`` (exact: a greedy draft token is accepted iff
  it equals the target argmax, and then the prefix is the target's); T=1:
  ``beta_j = sum_v min(p_j(v), q_j(v)) = 1 - TV(p_j, q_j)``, the acceptance probability of
  rejection sampling (Leviathan et al. 2023, Sec. 3, Def. 3.1). At T=1 this approximates the
  prefix after an accepted token by the target's own sample.
- SD steps simulated for k = 1..6: a step at position s accepts draft i with prob ``beta_{s+i-1}``
  until the first rejection (``--num-trials`` Monte Carlo runs, seeded); it emits accepted + 1
  tokens. Mean acceptance length = mean tokens per step (accepted + the recovered/bonus token);
  per-position acceptance rate = share of steps whose i-th draft token is accepted (vLLM's
  ``num_accepted_tokens_per_pos / num_drafts``).
- Reduced draft vocabulary (FR-Spec): the draft's logits over its ``N`` target ids are scattered
  into the target vocabulary with ``-inf`` elsewhere, so ``q`` is zero outside the subset.
- Cost: one decode forward (1 new token over a KV cache of ``--context`` tokens), 1 CPU thread,
  batch 1 and 16, median wall time (ms) of draft and target; ratio = draft / target.

Usage: ``python bench/draft_acceptance.py --draft drafts/smollm2-135m-instruct``. ``--device cuda
--acceptance-only --target-dir <HF dir>`` runs only the acceptance part on a GPU (to compare
drafts right after training; the committed figures come from the CPU run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specdec.config import ModelConfig
from specdec.distill import pad_batch
from specdec.draft_format import draft_vocab_ids, load_draft, read_meta, resolve_target_dir

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"
SINGLE_TURN = ("translation", "summarization", "qa", "math_reasoning", "rag")
MULTI_TURN = "multi_turn"
MAX_K = 6
TEMPERATURES = (0.0, 1.0)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load_prompts(tokenizer, path: str, num_per_category: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """Chat-template token ids per category (first turn)."""
    out: dict[str, list[list[int]]] = defaultdict(list)
    with open(path, encoding="utf-8") as f:
        for row in map(json.loads, filter(str.strip, f)):
            cat = row["category"] if row["category"] in SINGLE_TURN else MULTI_TURN
            if len(out[cat]) >= num_per_category:
                continue
            ids = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
            if len(ids) <= max_tokens:
                out[cat].append(list(ids))
    return dict(out)


@torch.no_grad()
def trajectory_betas(target, draft, prompts: list[list[int]], temperature: float, max_new: int, eos: int,
                     gen: torch.Generator, chunk: int = 4) -> list[torch.Tensor]:
    """Target trajectories of up to ``max_new`` tokens (batched, left-padded generation) and
    ``beta_j`` per generated position ``[n_i]`` for each prompt."""
    width, device = max(map(len, prompts)), target.device
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                              "top_k": None, "top_p": None}
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos,
                          pad_token_id=eos, **kwargs)[:, width:].tolist()
    pairs = [(p, row[:row.index(eos) + 1] if eos in row else row) for p, row in zip(prompts, out)]
    betas = []
    for start in range(0, len(pairs), chunk):
        ids, mask, is_resp = pad_batch(pairs[start:start + chunk], device)
        p_logits = target(input_ids=ids, attention_mask=mask).logits
        q_logits = target_vocab_logits(draft, draft(input_ids=ids, attention_mask=mask).logits, p_logits.shape[-1])
        for i in range(ids.shape[0]):
            p_i, q_i = p_logits[i][is_resp[i]], q_logits[i][is_resp[i]]
            if temperature == 0:
                betas.append((p_i.argmax(-1) == q_i.argmax(-1)).float().cpu())
            else:
                betas.append(torch.minimum(_probs(p_i, temperature), _probs(q_i, temperature)).sum(-1).clamp(0, 1).cpu())
    return betas


def simulate(betas: torch.Tensor, k: int, num_trials: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Accepted counts per simulated SD step and per-position accept counts ``[k]``."""
    steps, per_pos = [], [0] * k
    for _ in range(num_trials):
        s, n = 0, betas.numel()
        draws = torch.rand(n + k, generator=gen)
        while s < n:
            num_draft = min(k, n - s - 1) if n - s > 1 else 0
            a = 0
            while a < num_draft and draws[s + a] < betas[s + a]:
                per_pos[a] += 1
                a += 1
            steps.append(a)
            s += a + 1
    return steps, per_pos


def acceptance_table(betas_by_cat: dict[str, list[torch.Tensor]], num_trials: int, seed: int) -> dict:
    """Per category and ``all``: k -> mean acceptance length and per-position acceptance rates."""
    out = {}
    cats = dict(betas_by_cat, all=[b for bs in betas_by_cat.values() for b in bs])
    for cat, betas in cats.items():
        out[cat] = {}
        for k in range(1, MAX_K + 1):
            gen = torch.Generator().manual_seed(seed + k)
            steps, per_pos = [], [0] * k
            for b in betas:
                s, p = simulate(b, k, num_trials, gen)
                steps += s
                per_pos = [x + y for x, y in zip(per_pos, p)]
            out[cat][k] = {"mean_acceptance_length": 1 + sum(steps) / len(steps),
                           "acceptance_rate_per_pos": [x / len(steps) for x in per_pos],
                           "num_steps": len(steps)}
        out[cat]["mean_beta"] = float(torch.cat(betas).mean())
    return out


@torch.no_grad()
def sd_accepted_counts(target, draft, prompt: list[int], k: int, temperature: float, max_new: int,
                       gen: torch.Generator) -> list[int]:
    """Cross-check: real speculative decoding (draft k, verify, rejection sampling of Leviathan et
    al. 2023, Alg. 1) with KV caches for one prompt; returns the accepted count of each step."""
    t_cache, d_cache, seq, counts = DynamicCache(), DynamicCache(), list(prompt), []
    target(torch.tensor([seq[:-1]]), past_key_values=t_cache, use_cache=True)
    while len(seq) - len(prompt) < max_new:
        drafts, q_rows, feed = [], [], seq[d_cache.get_seq_length():]
        for _ in range(k):
            logits = draft(torch.tensor([feed]), past_key_values=d_cache, use_cache=True).logits[0, -1]
            q = _probs(target_vocab_logits(draft, logits, target.config.vocab_size), temperature)
            tok = int(q.argmax()) if temperature == 0 else int(torch.multinomial(q, 1, generator=gen))
            drafts, q_rows, feed = drafts + [tok], q_rows + [q], [tok]
        logits = target(torch.tensor([[seq[-1]] + drafts]), past_key_values=t_cache, use_cache=True).logits[0]
        p_rows = [_probs(row, temperature) for row in logits]
        accepted, new_tok = 0, None
        for i, tok in enumerate(drafts):
            ratio = 1.0 if temperature == 0 and int(p_rows[i].argmax()) == tok else (
                0.0 if temperature == 0 else float(p_rows[i][tok] / q_rows[i][tok]))
            if float(torch.rand(1, generator=gen)) >= min(1.0, ratio):
                residual = (p_rows[i] - q_rows[i]).clamp_min(0)
                new_tok = _sample(residual / residual.sum() if temperature > 0 else p_rows[i], temperature, gen)
                break
            accepted += 1
        if new_tok is None:
            new_tok = _sample(p_rows[k], temperature, gen)
        seq += drafts[:accepted] + [new_tok]
        counts.append(accepted)
        _crop_to(t_cache, len(seq) - 1)
        _crop_to(d_cache, len(seq) - 1)
    return counts


def target_vocab_logits(draft, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits ``[..., N]`` of a reduced-vocabulary draft -> ``[..., vocab_size]`` (-inf outside)."""
    ids = draft_vocab_ids(draft)
    if ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, ids, logits)


def _crop_to(cache: DynamicCache, length: int) -> None:
    """KV rollback to ``length`` tokens (no-op when the cache is not longer)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / (temperature or 1.0), -1)


def _sample(probs: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    return int(probs.argmax()) if temperature == 0 else int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def forward_ms(model, batch: int, context: int, num_iters: int) -> float:
    """Median wall time (ms) of one single-token decode forward over a ``context``-token KV cache."""
    cache = DynamicCache()
    ids = torch.randint(0, model.config.vocab_size, (batch, context))
    model(ids, past_key_values=cache, use_cache=True)
    times = []
    step = torch.randint(0, model.config.vocab_size, (batch, 1))
    for _ in range(num_iters):
        t0 = time.perf_counter()
        model(step, past_key_values=cache, use_cache=True)
        times.append((time.perf_counter() - t0) * 1e3)
        cache.crop(-1)  # drop the token just appended
    return statistics.median(times)


def write_markdown(res: dict, path: str) -> None:
    lines = [f"# Draft acceptance: `{res['draft']}` vs `{res['target']}`", "", res["method"], "",
             f"Prompts per category: {res['num_prompts']}; new tokens per prompt: {res['max_new_tokens']}.", ""]
    for temp, table in res["acceptance"].items():
        lines += [f"## Temperature {temp}: mean acceptance length (tokens/step)", "",
                  "| category | " + " | ".join(f"k={k}" for k in range(1, MAX_K + 1)) + " | mean beta |",
                  "|---" * (MAX_K + 2) + "|"]
        for cat, row in table.items():
            lines.append(f"| {cat} | " + " | ".join(f"{row[k]['mean_acceptance_length']:.2f}"
                                                    for k in range(1, MAX_K + 1)) + f" | {row['mean_beta']:.3f} |")
        lines += ["", f"Per-position acceptance rate (all categories), temperature {temp}:", ""]
        for k in range(1, MAX_K + 1):
            rates = ", ".join(f"{r:.3f}" for r in table["all"][k]["acceptance_rate_per_pos"])
            lines.append(f"- k={k}: {rates}")
        lines.append("")
    lines += ["## Cross-check: real speculative decoding (KV caches, rejection sampling), k=4", ""]
    for temp, c in res["real_sd_check"].items():
        lines.append(f"- temperature {temp}: mean acceptance length {c['mean_acceptance_length']:.2f} "
                     f"over {c['num_steps']} steps")
    lines += ["", "## Forward time (CPU, 1 thread, one decode token, median ms)", "",
              "| batch | draft ms | target ms | draft/target |", "|---|---|---|---|"]
    for b, t in res["forward_ms"].items():
        lines.append(f"| {b} | {t['draft']:.2f} | {t['target']:.2f} | {t['ratio']:.3f} |")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="drafts/smollm2-135m-instruct")
    ap.add_argument("--spec-bench", default=SPEC_BENCH)
    ap.add_argument("--num-per-category", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-trials", type=int, default=20)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--num-iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-check-per-category", type=int, default=1,
                    help="prompts per category for the real-SD cross-check at k=4")
    ap.add_argument("--out-name", default="draft_acceptance")
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    ap.add_argument("--target-dir", default=None, help="HF dir of the target (default: the draft's metadata)")
    ap.add_argument("--device", default="cpu", help="device of the acceptance part (cost is always CPU)")
    ap.add_argument("--acceptance-only", action="store_true", help="skip the real-SD check and the CPU timing")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target_dir = args.target_dir or resolve_target_dir(read_meta(args.draft), args.draft)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(args.device).eval()
    draft = load_draft(args.draft, ModelConfig(model=args.draft, device=args.device), target_model=target)
    prompts = load_prompts(tokenizer, args.spec_bench, args.num_per_category, args.max_prompt_tokens)
    gen = torch.Generator().manual_seed(args.seed)
    acceptance = {}
    for temp in TEMPERATURES:
        betas = {c: trajectory_betas(target, draft, ps, temp, args.max_new_tokens, tokenizer.eos_token_id, gen)
                 for c, ps in tqdm(prompts.items(), desc=f"T={temp} categories")}
        acceptance[str(temp)] = acceptance_table(betas, args.num_trials, args.seed)
        print(f"T={temp}: k=4 mean acceptance length {acceptance[str(temp)]['all'][4]['mean_acceptance_length']:.3f}",
              flush=True)
    check, fwd = {}, {}
    for temp in TEMPERATURES if not args.acceptance_only else ():
        counts = [c for ps in prompts.values() for p in ps[:args.num_check_per_category]
                  for c in sd_accepted_counts(target, draft, p, 4, temp, args.max_new_tokens, gen)]
        check[str(temp)] = {"k": 4, "num_steps": len(counts), "mean_acceptance_length": 1 + sum(counts) / max(len(counts), 1)}
        print(f"real SD check T={temp}: {check[str(temp)]}", flush=True)
    for b in (1, 16) if not args.acceptance_only else ():
        d, t = (forward_ms(m, b, args.context, args.num_iters) for m in (draft, target))
        fwd[str(b)] = {"draft": d, "target": t, "ratio": d / t}
    res = {"draft": args.draft, "target": read_meta(args.draft).target, "method": __doc__.split("\n\n", 1)[1],
           "num_prompts": {c: len(p) for c, p in prompts.items()}, "max_new_tokens": args.max_new_tokens,
           "acceptance": acceptance, "real_sd_check": check, "forward_ms": fwd, "device": args.device,
           "draft_training": read_meta(args.draft).training}
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, args.out_name + ".json"), "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    write_markdown(res, os.path.join(args.results_dir, args.out_name + ".md"))
    print(json.dumps(fwd, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
