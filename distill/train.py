"""The training half of ``minedraft distill`` (``distill.run``): the distillation loss, one
step, the held-out top-1 agreement and the resumable AdamW + cosine loop.

Loss after DistillSpec (Zhou et al. 2024, Sec. 3): forward ``KL(p_target || q_draft)`` with ``p``
renormalised over the teacher's kept top-k tokens, averaged over response tokens.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from distill.config import DistillConfig
from distill.data import pad_batch, target_to_draft_index
from specdec.models import draft_format as fmt


def distill_loss(draft_logits: torch.Tensor, top_vals: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(p || q)``, ``p = softmax(top_vals)`` on the top-k support.

    Args: draft logits ``[N, V]``, teacher top-k logits ``[N, k]`` and draft-head indices
    ``[N, k]``; an index ``-1`` marks a teacher token outside a reduced draft vocabulary: ``p`` is
    then renormalised over the kept tokens (rows that keep none are skipped).
    """
    is_kept = top_idx >= 0
    log_p = F.log_softmax(top_vals.float().masked_fill(~is_kept, float("-inf")), dim=-1)
    log_p = torch.where(is_kept, log_p, torch.zeros_like(log_p))  # finite everywhere: no NaN grads
    p = torch.where(is_kept, log_p.exp(), torch.zeros_like(log_p))
    log_q = F.log_softmax(draft_logits.float(), dim=-1).gather(-1, top_idx.long().clamp_min(0))
    has_any = is_kept.any(-1)
    return (p * (log_p - log_q)).sum(-1).sum() / has_any.sum().clamp_min(1)


def train_step(draft, batch_pairs, batch_teacher, device, lut=None) -> tuple[torch.Tensor, int]:
    """Loss of one batch (not yet backpropagated) and its number of response tokens.

    ``lut``: :func:`target_to_draft_index` of a reduced-vocabulary draft (None: full vocab).
    """
    ids, mask, is_resp = pad_batch(batch_pairs, device)
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state[is_resp]
    logits = draft.lm_head(hidden)
    vals = torch.cat([v for v, _ in batch_teacher]).to(device)
    idx = torch.cat([i for _, i in batch_teacher]).to(device).long()
    return distill_loss(logits, vals, idx if lut is None else lut[idx]), int(is_resp.sum())


@torch.no_grad()
def top1_agreement(draft, target, pairs, device, batch_size: int) -> float:
    """Share of response positions where draft argmax == target argmax (teacher-forced)."""
    hits, total = 0, 0
    for start in range(0, len(pairs), batch_size):
        ids, mask, is_resp = pad_batch(pairs[start:start + batch_size], device)
        t = target(input_ids=ids, attention_mask=mask).logits.argmax(-1)[is_resp]
        d = draft(input_ids=ids, attention_mask=mask).logits.argmax(-1)[is_resp]
        vocab_ids = fmt.draft_vocab_ids(draft)
        d = d if vocab_ids is None else vocab_ids[d]
        hits, total = hits + int((t == d).sum()), total + t.numel()
    return hits / max(total, 1)


def cosine_factor(step: int, num_steps: int, elapsed_s: float, time_left_s: float | None) -> float:
    """Cosine learning-rate factor in [0, 1] at the later of ``step / num_steps`` and
    ``elapsed_s / time_left_s`` (seconds of training so far / seconds it may take; None: steps only)."""
    frac = step / num_steps if time_left_s is None else max(step / num_steps, elapsed_s / max(time_left_s, 1e-3))
    return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def train(cfg: DistillConfig, draft, pairs, teacher, device: str, tag: str, t0: float | None = None) -> dict:
    """AdamW + cosine schedule over ``num_epochs``; resumes from ``work_dir/ckpt_<tag>.pt``.

    With ``cfg.time_budget_s`` the cosine runs over whichever ends first, the planned steps or the
    time left (so the learning rate is annealed when the budget stops training), and training stops
    once ``time.perf_counter() - t0`` exceeds the budget.
    """
    params = [p for n, p in draft.named_parameters() if n.startswith(fmt.OWN_WEIGHT_PREFIXES)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(pairs) / cfg.batch_size)
    num_steps = steps_per_epoch * cfg.num_epochs
    t_start = time.perf_counter() if t0 is None else t0
    t_train, time_left = time.perf_counter(), cfg.time_budget_s - (time.perf_counter() - t_start)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_factor(
        s, num_steps, time.perf_counter() - t_train, time_left if cfg.time_budget_s else None))
    ckpt_path, step, num_tokens, losses = os.path.join(cfg.work_dir, f"ckpt_{tag}.pt"), 0, 0, []
    vocab_ids = fmt.draft_vocab_ids(draft)
    lut = target_to_draft_index(vocab_ids, draft.config.vocab_size)
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(ck["draft"], strict=False)
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step, num_tokens, losses = ck["step"], ck["num_tokens"], ck["losses"]
    draft.train()
    bar = tqdm(total=num_steps, initial=step, desc="distill")
    while step < num_steps:
        epoch, pos = divmod(step, steps_per_epoch)
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        sel = order[pos * cfg.batch_size:(pos + 1) * cfg.batch_size]
        loss, n = train_step(draft, [pairs[i] for i in sel], [teacher[i] for i in sel], device, lut)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step, num_tokens = step + 1, num_tokens + n
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(kl=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
        is_out_of_time = 0 < cfg.time_budget_s < time.perf_counter() - t_start
        if step % cfg.checkpoint_every == 0 or step == num_steps or is_out_of_time:
            torch.save({"draft": fmt.own_state_dict(draft), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "num_tokens": num_tokens, "losses": losses}, ckpt_path)
        if is_out_of_time:
            break
    bar.close()
    draft.eval()
    tail = losses[-max(1, steps_per_epoch // 4):]
    return {"first_kl": losses[0] if losses else None, "final_kl": sum(tail) / len(tail),
            "num_steps": step, "num_planned_steps": num_steps, "num_train_tokens": num_tokens}
