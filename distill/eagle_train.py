"""Train an EAGLE-style draft head (``distill.eagle``) for a target by distillation.

Recipe: the data stage of ``distill.run`` (chat + synthetic task prompts, target-generated
responses; Spec-Bench excluded), then per batch one frozen target forward gives the features
``f`` and the teacher distribution; the head is unrolled ``--num-unroll`` steps (EAGLE-3's
training-time test, Li et al. 2025, arXiv 2503.01840, Sec. 3.2) and minimises, per step u,
``KL(p_target || q_head)`` over the draft vocabulary (the teacher renormalised to it), averaged
over chains; positions that predict prompt tokens weigh ``--prompt-weight``.

Usage (GPU): ``python -m distill.eagle_train --target <HF dir> --vocab-from drafts/smollm2-135m-instruct
--out <dir> <distill data flags> --time-budget-s 300``. Writes ``eagle_head.safetensors`` +
``eagle.json`` (target fingerprint, layers, summary) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from distill.config import DistillConfig
from distill.data import load_target, pad_batch
from distill.dataset import build_dataset
from distill.eagle import EagleHead, target_features, unrolled_logits
from distill.run import parse_args
from distill.train import cosine_factor
from specdec.models import draft_format as fmt

HEAD_FILE, META_FILE = "eagle_head.safetensors", "eagle.json"


@dataclass(frozen=True)
class EagleTrainConfig:
    """Head training settings (data settings live in the ``DistillConfig``). Raises ValueError."""

    out_dir: str
    vocab_from: str
    num_layers: int = 1
    init_layer: int = -1
    num_unroll: int = 3
    lr: float = 5e-4
    warmup_steps: int = 100
    max_batch_tokens: int = 16384
    num_epochs: int = 20
    prompt_weight: float = 0.2
    time_budget_s: float = 300.0
    seed: int = 0
    pairs_file: str = ""
    feature_layers: str = "-1"
    fusion: str = "concat"
    init_draft: str = ""

    @property
    def layers(self) -> tuple[int, ...]:
        """``feature_layers`` as indices into the target's ``hidden_states``."""
        return tuple(int(x) for x in self.feature_layers.split(","))

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_unroll", "max_batch_tokens", "num_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.prompt_weight < 0 or self.time_budget_s < 0:
            raise ValueError("lr must be > 0, prompt_weight and time_budget_s >= 0")


def length_batches(pairs, max_tokens: int, seed: int) -> list[list[int]]:
    """Indices of ``pairs`` grouped by length so that ``batch * longest <= max_tokens``, shuffled."""
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    batches, cur = [], []
    for i in order:
        width = len(pairs[i][0]) + len(pairs[i][1])
        if cur and (len(cur) + 1) * width > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    batches += [cur] if cur else []
    random.Random(seed).shuffle(batches)
    return batches


def chain_loss(head: EagleHead, target, batch_pairs, cfg: EagleTrainConfig, device) -> torch.Tensor:
    """Mean over steps of the weighted per-chain ``KL(p || q)`` (nats/token) of one batch."""
    num_unroll, prompt_weight = cfg.num_unroll, cfg.prompt_weight
    ids, mask, is_resp = pad_batch(batch_pairs, device)                  # [b, W] each
    with torch.no_grad():
        feats, final = target_features(target, ids, mask, cfg.layers)     # [b, W, F], [b, W, H]
    width = ids.shape[1]
    outs = unrolled_logits(head, feats, ids, mask[:, 1:].bool(), num_unroll)
    weight = is_resp.float() + prompt_weight * (mask.bool() & ~is_resp).float()     # [b, W]
    total = 0.0
    for u, draft_logits in enumerate(outs, start=1):
        rows = width - 1 - u                                               # chains whose teacher exists
        with torch.no_grad():
            teacher = F.log_softmax(head.logits(final[:, u:u + rows]).float(), dim=-1)   # [b, rows, N]
        log_q = F.log_softmax(draft_logits[:, :rows].float(), dim=-1)
        kl = (teacher.exp() * (teacher - log_q)).sum(-1)                   # [b, rows]
        w = weight[:, u:u + rows]
        total = total + (kl * w).sum() / w.sum().clamp(min=1.0)
    return total / num_unroll


def build_head(target, vocab_ids: torch.Tensor, cfg: EagleTrainConfig) -> EagleHead:
    """Head with layers copied from target layer ``init_layer`` and the target's final norm, or
    (``init_draft``) the decoder layers and norm of a token-level draft (``specdec.models.draft_format``)."""
    embed = target.model.embed_tokens.weight
    tied = target.lm_head.weight.data_ptr() == embed.data_ptr()
    own = fmt.read_draft_weights(cfg.init_draft) if cfg.init_draft else {}
    num_layers = len({k.split(".")[2] for k in own if k.startswith("model.layers.")}) or cfg.num_layers
    head = EagleHead(target.config, num_layers, embed, vocab_ids, None if tied else target.lm_head.weight,
                     num_feature_layers=len(cfg.layers), fusion=cfg.fusion)
    if own:
        head.load_state_dict({k.removeprefix("model."): v.float() for k, v in own.items()
                              if k.startswith(fmt.OWN_WEIGHT_PREFIXES)}, strict=False)
        return head.to(embed.device)
    src = target.model.layers[cfg.init_layer].state_dict()
    for layer in head.layers:
        layer.load_state_dict(src)
    head.norm.load_state_dict(target.model.norm.state_dict())
    return head.to(embed.device)


def train(head: EagleHead, target, pairs, cfg: EagleTrainConfig, device, t0: float) -> dict:
    """AdamW, linear warm-up then cosine annealed to the time budget; returns a summary."""
    params = [p for n, p in head.named_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    batches = length_batches(pairs, cfg.max_batch_tokens, cfg.seed)
    num_steps = len(batches) * cfg.num_epochs
    t_train, time_left = time.perf_counter(), cfg.time_budget_s - (time.perf_counter() - t0)
    losses, step = [], 0
    bar = tqdm(total=num_steps, desc="eagle")
    head.train()
    while step < num_steps and not 0 < cfg.time_budget_s < time.perf_counter() - t0:
        epoch, pos = divmod(step, len(batches))
        if pos == 0 and epoch:
            batches = length_batches(pairs, cfg.max_batch_tokens, cfg.seed + epoch)
        factor = min(1.0, (step + 1) / cfg.warmup_steps) * cosine_factor(
            step, num_steps, time.perf_counter() - t_train, time_left if cfg.time_budget_s else None)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * factor
        loss = chain_loss(head, target, [pairs[i] for i in batches[pos]], cfg, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
    bar.close()
    head.eval()
    tail = losses[-max(1, len(batches) // 4):]
    return {"first_kl": losses[0] if losses else None, "final_kl": sum(tail) / max(len(tail), 1),
            "num_steps": step, "num_planned_steps": num_steps, "num_batches_per_epoch": len(batches)}


def save_pairs(pairs, path: str) -> None:
    """(prompt, response) id pairs as one compressed npz: flat int32 ids + per-pair lengths."""
    import numpy as np
    flat = np.fromiter((t for p, r in pairs for t in p + r), dtype=np.int32)
    np.savez_compressed(path, ids=flat, lengths=np.array([[len(p), len(r)] for p, r in pairs], dtype=np.int64))


def load_pairs(path: str) -> list[tuple[list[int], list[int]]]:
    """Inverse of :func:`save_pairs`."""
    import numpy as np
    data = np.load(path)
    ids, out, pos = data["ids"].tolist(), [], 0
    for num_prompt, num_resp in data["lengths"].tolist():
        out.append((ids[pos:pos + num_prompt], ids[pos + num_prompt:pos + num_prompt + num_resp]))
        pos += num_prompt + num_resp
    return out


def save_head(head: EagleHead, out_dir: str, meta: dict) -> None:
    """Write the head's own weights (bf16) and ``eagle.json``."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: (v if v.dtype == torch.int64 else v.to(torch.bfloat16)).contiguous().cpu()
               for k, v in head.own_state_dict().items()}
    save_file(tensors, os.path.join(out_dir, HEAD_FILE))
    with open(os.path.join(out_dir, META_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def load_head(head_dir: str, target) -> EagleHead:
    """The head saved by :func:`save_head`, attached to ``target``'s embeddings (float32).

    Raises IncompatibleDraftError when ``target``'s embeddings do not match the recorded fingerprint.
    """
    with open(os.path.join(head_dir, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    embed = target.model.embed_tokens.weight
    fmt.check_fingerprint(meta["target_fingerprint"], embed)
    state = load_file(os.path.join(head_dir, HEAD_FILE))
    head = EagleHead(target.config, meta["num_layers"], embed, state["vocab_ids"],
                     num_feature_layers=len(meta.get("feature_layers", [-1])), fusion=meta.get("fusion", "concat"))
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False)
    return head.to(embed.device).eval()


def run(data_cfg: DistillConfig, cfg: EagleTrainConfig) -> dict:
    """Data stage, training, save; returns the summary."""
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and data_cfg.device != "cpu" else "cpu"
    os.makedirs(data_cfg.work_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_target(data_cfg, device)
    if cfg.pairs_file and os.path.exists(cfg.pairs_file):
        pairs, task_summary = load_pairs(cfg.pairs_file), {"pairs_file": cfg.pairs_file}
    else:
        pairs, _, _, _, task_summary = build_dataset(data_cfg, target, tokenizer, device, with_teacher=False)
        if cfg.pairs_file:
            save_pairs(pairs, cfg.pairs_file)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    vocab_ids = fmt.read_draft_weights(cfg.vocab_from)[fmt.DRAFT_VOCAB_KEY].to(device)
    head = build_head(target, vocab_ids, cfg)
    t_data = time.perf_counter() - t0
    summary = train(head, target, pairs, cfg, device, t0)
    summary.update(data_time_s=round(t_data, 1), wall_time_s=round(time.perf_counter() - t0, 1),
                   num_train_sequences=len(pairs), num_train_tokens=sum(len(p) + len(r) for p, r in pairs),
                   config={k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, device=device, **task_summary)
    meta = {"kind": "eagle", "target": data_cfg.record_target or data_cfg.target,
            "target_fingerprint": fmt.embedding_fingerprint(target.model.embed_tokens.weight),
            "num_layers": len(head.layers), "init_layer": cfg.init_layer, "draft_vocab_size": int(vocab_ids.numel()),
            "feature_layers": list(cfg.layers), "fusion": cfg.fusion, "init_draft": cfg.init_draft,
            "training": summary}
    save_head(head, cfg.out_dir, meta)
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: EAGLE flags plus every ``distill.run`` data flag (``--max-prompts``, ``--task-corpus``, ...)."""
    ap = argparse.ArgumentParser(prog="python -m distill.eagle_train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", dest="out_dir", required=True, help="head directory to write")
    ap.add_argument("--vocab-from", required=True, help="draft dir whose draft_vocab_ids the head uses")
    for f in EagleTrainConfig.__dataclass_fields__.values():
        if f.name not in ("out_dir", "vocab_from"):
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ns, rest = ap.parse_known_args(argv)
    data_cfg = parse_args(rest + ["--out", ns.out_dir])
    work = data_cfg.work_dir or os.path.join(ns.out_dir, "work")
    data_cfg = replace(data_cfg, work_dir=work)
    cfg = EagleTrainConfig(**vars(ns))
    print(json.dumps(run(data_cfg, cfg), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
