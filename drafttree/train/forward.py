"""Training forwards: the frozen target's context features and the drafter over many blocks.

The drafter's training forward reuses its own submodules and matches `DFlashDrafter.forward`
block for block; only the attention differs: "dense" is one boolean mask over
keys = [context projections for all T positions ; all blocks' projections] (SDPA);
"blockwise" computes the same softmax without the all-blocks x all-blocks part.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashDrafter
from drafttree.kernels.torch_ops import apply_rope
from drafttree.models.kv_cache import KVCache, attn_meta, causal
from drafttree.train.recipe import IGNORE, Blocks


class FeatureExtractor:
    """Runs the frozen target over padded batches in one KV cache, grown only when a batch
    does not fit (size it with the largest batch and sequence up front)."""

    def __init__(self, target: DecoderLM, layer_ids: tuple[int, ...], rows: int = 1, max_len: int = 16) -> None:
        self.target, self.layer_ids = target, tuple(layer_ids)
        self.rows, self.max_len = rows, max_len
        self.cache: KVCache | None = None

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> hidden states after `layer_ids`, concatenated: [B, T, n*D].
        Padding sits after each row's tokens, so causal attention keeps it out of the rows."""
        B, T = input_ids.shape
        c, w = self.target.cfg, self.target.embed_tokens.weight
        if self.cache is None or self.cache.rows < B or self.cache.max_len < T:
            self.rows, self.max_len = max(self.rows, B), max(self.max_len, T)
            self.cache = None
            self.cache = KVCache.allocate(c.num_layers, self.rows, self.max_len, c.num_kv_heads, c.head_dim,
                                          w.dtype, w.device, c.v_cache_dim)
        dev = input_ids.device
        meta = attn_meta(torch.zeros(B, dtype=torch.long, device=dev), causal(B, T, dev), T)
        pos = torch.arange(T, device=dev).expand(B, T)
        _, aux = self.target(input_ids, pos, meta, self.cache.k, self.cache.v, self.layer_ids)
        return aux


ATTENTION = ("dense", "blockwise")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, W, H, hd]; k, v [B, K, Hkv, hd]; mask [B, W, K] -> [B, W, H*hd]."""
    B, W, H, hd = q.shape
    g = H // k.shape[2]
    k = k.repeat_interleave(g, dim=2) if g > 1 else k
    v = v.repeat_interleave(g, dim=2) if g > 1 else v
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=1.0 / math.sqrt(hd))
    return out.transpose(1, 2).reshape(B, W, H * hd)


def blockwise_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kb: torch.Tensor,
                        vb: torch.Tensor, ctx_mask: torch.Tensor, bs: int) -> torch.Tensor:
    """The same attention without the W x W block part of the dense mask, which is zero off
    the diagonal: scores against the context [W, T] and against the own block [N, bs, bs]
    share one softmax. q, kb, vb [B, W, *, hd]; kc, vc [B, T, Hkv, hd]; ctx_mask [B, W, T]."""
    B, W, H, hd = q.shape
    T, Hkv, N = kc.shape[1], kc.shape[2], W // bs
    g = H // Hkv
    qg = q.reshape(B, N, bs, Hkv, g, hd) * (1.0 / math.sqrt(hd))
    s_ctx = torch.einsum("bnqkgd,btkd->bkgnqt", qg, kc)
    s_ctx = s_ctx.masked_fill(~ctx_mask.view(B, 1, 1, N, bs, T), float("-inf"))
    s_blk = torch.einsum("bnqkgd,bnjkd->bkgnqj", qg, kb.view(B, N, bs, Hkv, hd))
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1, dtype=torch.float32).to(vc.dtype)
    out = torch.einsum("bkgnqt,btkd->bnqkgd", p[..., :T], vc) \
        + torch.einsum("bkgnqj,bnjkd->bnqkgd", p[..., T:], vb.view(B, N, bs, Hkv, hd))
    return out.reshape(B, W, H * hd)


def drafter_train_forward(drafter: DFlashDrafter, ctx_feat: torch.Tensor, blocks: Blocks,
                          attention: str = "dense") -> torch.Tensor:
    """ctx_feat [B, T, n*D] raw target features; returns the final-normed hidden [B, W, D]."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    dtype = drafter.fc.weight.dtype
    B, T = ctx_feat.shape[:2]
    x = drafter.embed(blocks.ids).to(dtype)
    ctx = drafter.context(ctx_feat.to(dtype))
    ctx_pos = torch.arange(T, device=ctx_feat.device).expand(B, T)
    rq = drafter.rotary(blocks.pos, x.dtype)
    rc = drafter.rotary(ctx_pos, x.dtype)
    mask = blocks.dense_mask(T) if attention == "dense" else blocks.ctx_mask(T)
    for layer in drafter.layers:
        attn = layer.self_attn
        q, kb, vb = attn.project(layer.input_layernorm(x))
        _, kc, vc = attn.project(ctx)
        q, kb, kc = apply_rope(q, *rq), apply_rope(kb, *rq), apply_rope(kc, *rc)
        if attention == "dense":
            o = dense_attention(q, torch.cat([kc, kb], dim=1), torch.cat([vc, vb], dim=1), mask)
        else:
            o = blockwise_attention(q, kc, vc, kb, vb, mask, blocks.block_size)
        x = layer.residual_mlp(x, attn.o_proj(o))
    return drafter.norm(x)


@dataclass
class LossOutput:
    loss: torch.Tensor           # weighted mean cross-entropy (differentiable)
    correct: torch.Tensor        # [bs] argmax hits per block position (long)
    count: torch.Tensor          # [bs] labelled tokens per block position (long)
    accepted: torch.Tensor       # () sum over blocks of the leading correct run (long)
    blocks: torch.Tensor         # () blocks with at least one label (long)


def _ce_chunk(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h.to(weight.dtype), weight).float()
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(dim=-1)


def block_loss(hidden: torch.Tensor, blocks: Blocks, lm_head: torch.nn.Linear, pos_weights: torch.Tensor,
               chunk: int = 8192) -> LossOutput:
    """Cross-entropy through the target's LM head at the labelled positions only, in chunks
    whose logits are recomputed in backward instead of kept."""
    bs = blocks.block_size
    labels = blocks.labels.reshape(-1)
    sel = (labels != IGNORE).nonzero().squeeze(1)
    h, y = hidden.reshape(-1, hidden.shape[-1])[sel], labels[sel]
    kpos = sel % bs
    w = pos_weights.to(hidden.device)[kpos]
    ce_parts, pred_parts = [], []
    for s in range(0, len(sel), chunk):
        ce, pred = checkpoint(_ce_chunk, h[s:s + chunk], y[s:s + chunk], lm_head.weight, use_reentrant=False)
        ce_parts.append(ce)
        pred_parts.append(pred)
    ce = torch.cat(ce_parts) if ce_parts else hidden.new_zeros(0)
    pred = torch.cat(pred_parts) if pred_parts else y
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        hit = pred == y
        correct = torch.zeros(bs, dtype=torch.long, device=hidden.device).index_add_(0, kpos, hit.long())
        count = torch.bincount(kpos, minlength=bs)
        full = torch.zeros_like(labels, dtype=torch.bool)
        full[sel] = hit
        lead = full.view(-1, bs)[:, 1:].long().cumprod(dim=1).sum(dim=1)
        has = (labels.view(-1, bs) != IGNORE).any(dim=1)
    return LossOutput(loss, correct, count, lead[has].sum(), has.sum())


def eager():
    """Run the models' compiled inference pieces eagerly: in training they would recompile for
    every grad-mode / autocast / dtype mix and hit Dynamo's recompile limit."""
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()
