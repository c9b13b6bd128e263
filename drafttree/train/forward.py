"""Training forwards: the frozen target's context features and the drafter over many blocks.

The drafter's training forward reuses its own submodules and matches `DFlashDrafter.forward`
(and `DFlash2Drafter.forward`: each block's convolutions run along its own positions) block for
block; only the attention differs: "dense" is one boolean mask over
keys = [context projections for all T positions ; all blocks' projections] (SDPA);
"blockwise" computes the same softmax without the all-blocks x all-blocks part.

The loss (`block_loss`) is the cross-entropy against the sequence's tokens (the recipe's), or the
KL divergence to the target's own distribution at each labelled position (distillation: the
target runs alongside, its logits are those of the forward that gives the features); for a
DFlash2 drafter plus the selector's K-way cross-entropy over the unary top K, its predecessors
the sequence's own tokens (teacher forcing), the label put in the last candidate's place where
the top K lacks it.
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
from drafttree.models.dflash2 import CandidateSelector, DFlash2Drafter
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
        return self.with_final(input_ids)[0]

    @torch.no_grad()
    def with_final(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the features, the target's final-normed hidden states [B, T, D]: its logits' input)."""
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
        final, aux = self.target(input_ids, pos, meta, self.cache.k, self.cache.v, self.layer_ids)
        return aux, final


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
    conv = isinstance(drafter, DFlash2Drafter)
    if conv and drafter.cfg.input_embedding_scale != 1.0:
        x = x * drafter.cfg.input_embedding_scale
    ctx = drafter.context(ctx_feat.to(dtype))
    ctx_pos = torch.arange(T, device=ctx_feat.device).expand(B, T)
    rq = drafter.rotary(blocks.pos, x.dtype)
    rc = drafter.rotary(ctx_pos, x.dtype)
    mask = blocks.dense_mask(T) if attention == "dense" else blocks.ctx_mask(T)
    window = drafter.cfg.sliding_window if conv else None
    if window is not None:   # the context a block's query may see: within the window (the block always is)
        near = blocks.pos[:, :, None] - torch.arange(T, device=mask.device) < window
        mask = mask & (torch.cat([near, near.new_ones(B, x.shape[1], mask.shape[2] - T)], dim=2)
                       if attention == "dense" else near)
    bs = blocks.block_size

    def sublayer(conv_module, h: torch.Tensor, run) -> torch.Tensor:
        """run(h) between the two halves of the block's convolution (DFlash2), or just run(h)."""
        if not conv:
            return run(h)
        h, coef = conv_module.prepare(h.unflatten(1, (-1, bs)))
        return conv_module.finish(run(h.flatten(1, 2)).unflatten(1, (-1, bs)), coef).flatten(1, 2)

    for layer in drafter.layers:
        attn = layer.self_attn

        def attend(h: torch.Tensor) -> torch.Tensor:
            q, kb, vb = attn.project(h)
            _, kc, vc = attn.project(ctx)
            q, kb, kc = apply_rope(q, *rq), apply_rope(kb, *rq), apply_rope(kc, *rc)
            if attention == "dense":
                o = dense_attention(q, torch.cat([kc, kb], dim=1), torch.cat([vc, vb], dim=1), mask)
            else:
                o = blockwise_attention(q, kc, vc, kb, vb, mask, bs)
            return attn.o_proj(o)

        if conv:
            x = x + sublayer(layer.attention_conv, layer.input_layernorm(x), attend)
            x = x + sublayer(layer.mlp_conv, layer.post_attention_layernorm(x), layer.mlp)
        else:
            x = layer.residual_mlp(x, attend(layer.input_layernorm(x)))
    return drafter.norm(x)


def check_trainable(drafter: DFlashDrafter) -> None:
    """Refuse a drafter the training forward and loss would not compute as the engine does."""
    if not isinstance(drafter, DFlash2Drafter):
        return
    c = drafter.cfg
    if c.causal:
        raise ValueError("training a causal DFlash2 drafter (is_causal / dflash_config.causal) is not supported: "
                         "the training attention sees a whole block")
    if c.output_multiplier != 1.0 or c.logit_softcap is not None:
        raise ValueError("training a DFlash2 drafter with output_multiplier or final_logit_softcapping is not "
                         "supported: the loss takes the LM head's logits as they are")
    if c.sliding_window is not None and c.sliding_window < c.block_size:
        raise ValueError(f"training with a sliding_window ({c.sliding_window}) narrower than a block "
                         f"({c.block_size}) is not supported")


LOSSES = ("ce", "kl")


@dataclass
class LossOutput:
    loss: torch.Tensor           # weighted mean loss (differentiable): the unary term, plus the selector's
    correct: torch.Tensor        # [bs] argmax hits per block position (long)
    count: torch.Tensor          # [bs] labelled tokens per block position (long)
    accepted: torch.Tensor       # () sum over blocks of the leading correct run (long)
    blocks: torch.Tensor         # () blocks with at least one label (long)
    selector: torch.Tensor | None = None   # () the selector's weighted K-way cross-entropy (DFlash2; detached)


@dataclass
class SelectorTerm:
    """The selector's part of a DFlash2 drafter's loss: its module, K, and the weight of its term."""
    module: CandidateSelector
    top_k: int
    weight: float = 1.0


def _head_chunk(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor | None,
                pred_ids: torch.Tensor | None, selector: SelectorTerm | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the unary loss (CE against y, or KL(teacher || drafter) with the teacher's
    final hidden rows), the argmax, and the selector's CE (zeros without a selector)."""
    logits = F.linear(h.to(weight.dtype), weight).float()
    if teacher is None:
        unary = F.cross_entropy(logits, y, reduction="none")
    else:
        with torch.no_grad():
            p_log = F.linear(teacher.to(weight.dtype), weight).float().log_softmax(-1)
        unary = (p_log.exp() * (p_log - logits.log_softmax(-1))).sum(-1)
    if selector is None:
        return unary, logits.argmax(dim=-1), torch.zeros_like(unary)
    with torch.no_grad():
        cand = logits.topk(selector.top_k, dim=-1).indices
        hit = cand == y[:, None]
        present = hit.any(-1)
        cand[:, -1] = torch.where(present, cand[:, -1], y)
        at = torch.where(present, hit.long().argmax(-1), selector.top_k - 1)
    m = selector.module
    ctx = m.predecessor_codebook[pred_ids].float() * m.hidden_projection(h).float()
    scores = logits.gather(1, cand) + torch.einsum("nr,nkr->nk", ctx, m.successor_codebook[cand].float())
    return unary, logits.argmax(dim=-1), F.cross_entropy(scores, at, reduction="none")


def block_loss(hidden: torch.Tensor, blocks: Blocks, lm_head: torch.nn.Linear, pos_weights: torch.Tensor,
               chunk: int = 8192, teacher: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
               selector: SelectorTerm | None = None) -> LossOutput:
    """The loss through the target's LM head at the labelled positions only, in chunks whose
    logits are recomputed in backward instead of kept: cross-entropy against the labels, or with
    `teacher` (the target's final hidden states [B, T, D] of the sequences) the KL divergence to
    its distribution for each label's position; with `selector` (DFlash2; needs `input_ids`
    [B, T], the predecessors) plus its weighted K-way cross-entropy."""
    bs = blocks.block_size
    labels = blocks.labels.reshape(-1)
    sel = (labels != IGNORE).nonzero().squeeze(1)
    h, y = hidden.reshape(-1, hidden.shape[-1])[sel], labels[sel]
    if selector is not None and input_ids is None:
        raise ValueError("the selector's loss needs the sequences' input_ids (its predecessors)")

    def before(t: torch.Tensor) -> torch.Tensor:
        """Rows of t [B, T, ...] at the position before each label's (whose logits predict it)."""
        at = (blocks.pos.clamp(1, t.shape[1]) - 1).reshape(*blocks.pos.shape, *([1] * (t.dim() - 2)))
        return t.gather(1, at.expand(-1, -1, *t.shape[2:])).flatten(0, 1)[sel]

    th = None if teacher is None else before(teacher)
    prev = None if selector is None else before(input_ids)
    kpos = sel % bs
    w = pos_weights.to(hidden.device)[kpos]
    parts = []
    for s in range(0, len(sel), chunk):
        part = slice(s, s + chunk)
        parts.append(checkpoint(_head_chunk, h[part], y[part], lm_head.weight, None if th is None else th[part],
                                None if prev is None else prev[part], selector, use_reentrant=False))
    unary, pred, sel_ce = (torch.cat(t) for t in zip(*parts)) if parts else \
        (hidden.new_zeros(0), y, hidden.new_zeros(0))
    wsum = w.sum().clamp_min(1e-6)
    loss = (unary * w).sum() / wsum
    selector_loss = None
    if selector is not None:
        selector_loss = (sel_ce * w).sum() / wsum
        loss = loss + selector.weight * selector_loss
    with torch.no_grad():
        hit = pred == y
        correct = torch.zeros(bs, dtype=torch.long, device=hidden.device).index_add_(0, kpos, hit.long())
        count = torch.bincount(kpos, minlength=bs)
        full = torch.zeros_like(labels, dtype=torch.bool)
        full[sel] = hit
        lead = full.view(-1, bs)[:, 1:].long().cumprod(dim=1).sum(dim=1)
        has = (labels.view(-1, bs) != IGNORE).any(dim=1)
    return LossOutput(loss, correct, count, lead[has].sum(), has.sum(),
                      None if selector_loss is None else selector_loss.detach())


def eager():
    """Run the models' compiled inference pieces eagerly: in training they would recompile for
    every grad-mode / autocast / dtype mix and hit Dynamo's recompile limit."""
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()
