"""EAGLE-style draft head: drafts from the TARGET's hidden states instead of from tokens alone.

Source: EAGLE (Li et al. 2024, arXiv 2401.15077, Sec. 3): the draft is one (or a few) decoder
layers fed, at position j, the target's feature ``f_j`` (here: the target's final, normed hidden
state, the input of its LM head) fused with the embedding of the next token ``t_{j+1}``; it
predicts the feature ``f_{j+1}``, and the target's own LM head rows turn that into draft logits
for ``t_{j+2}``. Drafting further steps feeds the head's own predicted feature back in. Training
unrolls those steps with the "training-time test" of EAGLE-3 (Li et al. 2025, arXiv 2503.01840,
Sec. 3.2) so later steps see predicted, not true, features.

Alignment (tokens ``t_0..t_{n-1}``, target features ``f_0..f_{n-1}``, ``f_j`` predicts ``t_{j+1}``):

- head position ``j`` (RoPE position j): input ``(f_j, t_{j+1})``; output ``g_j ~ f_{j+1}``.
- a *chain* from position ``p`` drafts after committed ``t_0..t_{p+1}``: step 1 is head position
  ``p`` (true input), step ``u >= 2`` is position ``p + u - 1`` with input ``(g, t_{p+u})`` where
  ``g`` is step ``u - 1``'s output; step ``u``'s logits predict ``t_{p+u+1}``. Step u attends to the
  true positions ``0..p`` and to the chain's own steps ``2..u``.

Embeddings and LM head rows are borrowed from the target (never stored); the head has a reduced
draft vocabulary (FR-Spec, Zhao et al. 2025) given by ``vocab_ids``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

NEG_INF = float("-inf")
FUSIONS = ("concat", "add")
TOP_FEATURE = (-1,)  # feature_layers of EAGLE-1: the target's final normed hidden state only


def target_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target features [b, T, len(feature_layers) * H] of a (right-padded) batch, and the final
    normed hidden state [b, T, H] (the LM head's input).

    ``feature_layers`` index HF's ``hidden_states`` (0: embeddings, i: output of decoder layer i,
    the last: the final normed state, also ``-1``); EAGLE-3 fuses a low, a mid and a high one.
    """
    if tuple(feature_layers) == TOP_FEATURE:
        final = target.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return final, final
    out = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1), out.hidden_states[-1]


class EagleHead(nn.Module):
    """Feature-level draft head.

    Args:
        config: the TARGET's Llama config (hidden size, heads, RoPE); ``num_layers`` decoder
            layers of that shape are built.
        num_layers: decoder layers of the head (>= 1).
        embed: target token embeddings ``[V, H]`` (borrowed, frozen, not saved).
        vocab_ids: int64 ``[N]`` sorted target ids of the draft head; head rows are ``embed``'s
            rows (tied SmolLM2 head) or ``head_weight``'s rows when given.
        head_weight: target LM head ``[V, H]`` when it is not tied to ``embed``.
        num_feature_layers: target layers fused into one input feature (``feature_layers``).
        fusion: ``concat`` (EAGLE: ``fc([e; a])``, ``a`` the projected target feature or, in a
            chain, the head's own output) or ``add`` (a token-level draft whose input embedding
            gets ``+ P_t(f)`` / ``+ P_c(g)``, both zero-initialised, so a warm-started draft
            starts exactly as it was).

    Raises:
        ValueError: ``num_layers < 1``, an unknown ``fusion`` or embed / vocab_ids of the wrong shape.
    """

    def __init__(self, config: LlamaConfig, num_layers: int, embed: torch.Tensor, vocab_ids: torch.Tensor,
                 head_weight: torch.Tensor | None = None, num_feature_layers: int = 1,
                 fusion: str = "concat") -> None:
        super().__init__()
        if num_layers < 1 or num_feature_layers < 1 or fusion not in FUSIONS:
            raise ValueError(f"need num_layers >= 1, num_feature_layers >= 1, fusion in {FUSIONS}; got "
                             f"{num_layers}, {num_feature_layers}, {fusion!r}")
        hidden = config.hidden_size
        if embed.dim() != 2 or embed.shape[1] != hidden:
            raise ValueError(f"embed must be [V, {hidden}], got {tuple(embed.shape)}")
        if vocab_ids.dim() != 1 or vocab_ids.dtype != torch.int64 or int(vocab_ids.max()) >= embed.shape[0]:
            raise ValueError(f"vocab_ids must be int64 [N] ids below {embed.shape[0]}, got {vocab_ids.dtype} "
                             f"{tuple(vocab_ids.shape)}")
        cfg = LlamaConfig.from_dict({**config.to_dict(), "num_hidden_layers": num_layers, "layer_types": None})
        cfg._attn_implementation = "sdpa"
        self.config, self.fusion = cfg, fusion
        self.feature_proj = None
        if fusion == "add" or num_feature_layers > 1:
            self.feature_proj = nn.Linear(num_feature_layers * hidden, hidden, bias=False)
        if fusion == "concat":
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        else:
            self.chain_proj = nn.Linear(hidden, hidden, bias=False)
            for proj in (self.feature_proj, self.chain_proj):
                nn.init.zeros_(proj.weight)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(num_layers))
        self.norm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.register_buffer("vocab_ids", vocab_ids.clone(), persistent=True)
        self.embed = embed.detach()                                      # [V, H], borrowed
        self.head_rows = (embed if head_weight is None else head_weight).detach()[vocab_ids]  # [N, H]

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own weights (fc, layers, norm, vocab_ids); borrowed tensors excluded."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    def forward(self, features: torch.Tensor, next_token_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: DynamicCache | None = None,
                is_target_feature: bool = True) -> torch.Tensor:
        """One pass over T head positions.

        Args:
            features: [b, T, F] the target's features (``is_target_feature``; F = H times the
                number of fused layers), or [b, T, H] the head's own outputs (chain steps).
            next_token_ids: [b, T] int64 target ids ``t_{j+1}`` fused with them.
            position_ids: [b, T] int64 RoPE positions.
            attention_mask: additive float [b, 1, T, T_past + T] (0 or -inf), or None for causal.
            cache: the layers' K/V of earlier passes, extended in place.

        Returns:
            output features g [b, T, H] (after the head's final norm).
        """
        e = self.embed[next_token_ids].to(features.dtype)
        a = self.feature_proj(features) if is_target_feature and self.feature_proj is not None else features
        if self.fusion == "concat":
            x = self.fc(torch.cat([e, a], dim=-1))
        else:
            x = e + (a if is_target_feature else self.chain_proj(a))
        pos_emb = self.rotary(x, position_ids)
        mask = attention_mask
        if mask is None and x.shape[1] > 1:
            mask = causal_mask(x.shape[1], x.device, x.dtype)[None, None]
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=cache is not None, position_embeddings=pos_emb)
        return self.norm(x)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary: [..., H] -> [..., N]."""
        return g @ self.head_rows.to(g.dtype).T


def causal_mask(length: int, device, dtype) -> torch.Tensor:
    """Additive causal mask [length, length]: 0 on and below the diagonal, -inf above."""
    return torch.full((length, length), NEG_INF, device=device, dtype=dtype).triu(1)


def chain_mask(key_valid: torch.Tensor, step: int, dtype) -> torch.Tensor:
    """Additive mask of unrolled step ``step`` (1-based) over ``step`` blocks of keys.

    Args:
        key_valid: bool [b, T], True at real (non-padding) head positions.
        step: the step whose queries attend; blocks are step 1 (true features) .. ``step``.

    Returns:
        [b, 1, T, step * T]: chain p (query row p) sees true positions ``p' <= p`` and its own
        position p in every later block (EAGLE-3's training-time-test mask).
    """
    b, length = key_valid.shape
    eye = torch.eye(length, dtype=torch.bool, device=key_valid.device)
    first = torch.ones(length, length, dtype=torch.bool, device=key_valid.device).tril() & key_valid[:, None, :]
    blocks = [first] + [eye.expand(b, length, length)] * (step - 1)
    allowed = torch.cat(blocks, dim=-1)
    out = torch.zeros(allowed.shape, dtype=dtype, device=key_valid.device).masked_fill_(~allowed, NEG_INF)
    return out[:, None]


def unrolled_logits(head: EagleHead, features: torch.Tensor, token_ids: torch.Tensor,
                    key_valid: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
    """Draft logits of every chain for steps 1..num_steps, all chains in parallel.

    A *sink* position comes first: input ``(0, t_0)`` (no feature precedes the first token), so
    the head attends to the first token as the target does (and a warm-started token-level draft
    keeps its attention sink). At serving time the head's KV starts with the same position.

    Args:
        features: [b, T+1, F] target features ``f_0..f_T`` of a padded batch.
        token_ids: [b, T+1] int64 tokens ``t_0..t_T`` (padding: any valid id).
        key_valid: bool [b, T] True where head position j has a real input ``(f_j, t_{j+1})``.
        num_steps: unrolled draft steps (>= 1).

    Returns:
        ``num_steps`` tensors [b, T, N]: entry u-1 holds chain p's step-u logits at row p, which
        predict ``t_{p+u+1}`` (rows whose inputs ran past the sequence hold garbage; mask them).
    """
    b, width = token_ids.shape
    features = torch.cat([features.new_zeros(b, 1, features.shape[-1]), features], dim=1)
    token_ids = torch.cat([token_ids[:, :1], token_ids], dim=1)
    key_valid = torch.cat([key_valid.new_ones(b, 1), key_valid], dim=1)
    length = width                                                        # head positions incl. the sink
    positions = torch.arange(length, device=token_ids.device).expand(b, length)
    cache, out, g = DynamicCache(), [], features[:, :-1]
    for u in range(1, num_steps + 1):
        nxt = token_ids.gather(1, (positions + u).clamp(max=length))      # t_{p+u} (shifted by the sink)
        g = head(g, nxt, positions + u - 1, chain_mask(key_valid, u, features.dtype), cache, is_target_feature=u == 1)
        out.append(head.logits(g[:, 1:]))
    return out
