"""Building blocks shared by the target decoder and the DFlash drafter."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.kernels import dispatch
from drafttree.kernels.fused import fused
from drafttree.kernels.invariant_attn import Visible, visible_keys
from drafttree.kernels.torch_ops import silu_mul
from drafttree.parallel.comm import all_reduce
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import kv_heads_per_rank, q_span


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the next norm in one kernel."""
        return dispatch.add_rms_norm(x, delta, self.weight, self.eps)


class LMHead(nn.Linear):
    """The LM head of one device: hidden states to logits as `dispatch.linear` computes them (the
    tiles in deterministic mode, else cuBLAS), so a token's logits follow the projections' rule."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self.weight)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    # on the CPU even inside a meta-device block (a model built to be loaded): meta arithmetic
    # alone imports torch's compiler, about a second on a small CPU; the loader rebuilds the tables
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type") == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, dtype)


@fused
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, W, 1, hd] of positions [B, W] (one kernel on CUDA, not five)."""
    freqs = positions.float()[..., None] * inv_freq  # [B, W, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass
class AttnMeta:
    """How one forward's new tokens meet the KV cache (`models.kv_cache.attn_meta` builds it).

    Token i of row b writes its K/V to cache[rows[b], :, slots[b, i]].
    mask[b, 0, i, j]: query i may see the request's position j, for j < kv_len.
    Paged cache: rows are 0 (one pool), slots are pool slots, and position j of row b is read
    from slot kv_slots[b, j]. Else batch row b is cache row b and position j is slot j.
    """
    slots: torch.Tensor      # [B, W] long
    mask: torch.Tensor       # [B, 1, W, kv_len] bool
    rows: torch.Tensor       # [B, 1] long: arange(B), or zeros (paged)
    kv_slots: torch.Tensor | None = None   # [B, kv_len] long (paged): the slot of every position read
    positions: torch.Tensor | None = None  # [B, W] long (paged): the new tokens' positions

    _made: dict = field(default_factory=dict, repr=False)   # what the mask gave, once per forward

    @property
    def kv_len(self) -> int:
        return self.mask.shape[-1]

    def visible_keys(self) -> Visible:
        """Each token's visible keys in order (`invariant_attn.visible_keys`), built once per forward."""
        if "visible" not in self._made:
            self._made["visible"] = visible_keys(self.mask)
        return self._made["visible"]

    def grouped_mask(self, g: int) -> torch.Tensor:
        """The mask for g query heads folded into the row dimension, built once per forward."""
        if g == 1:
            return self.mask
        if g not in self._made:
            B, _, W, L = self.mask.shape
            self._made[g] = self.mask.expand(B, g, W, L).reshape(B, 1, g * W, L)
        return self._made[g]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta,
                     k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q [B, W, H, hd]; k, v [B, Wk, Hkv, hd] written at meta.slots; returns [B, W, H*hd].

    k_cache / v_cache: one layer's cache, [rows, Hkv, max_len, hd]. Head-major, so that rows and
    heads fold into one batch stride and the matmuls read the cache in place: a token-major cache
    made torch copy it for every batch above 1 (benchmarks/attn_layouts.py: 8x slower at batch 16).
    """
    dispatch.write_kv(k_cache, v_cache, meta.rows, meta.slots, k, v)
    return attend(q, meta, k_cache, v_cache)


def attend(q: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The attention of `cached_attention` once K/V are in the cache: q [B, W, H, hd] -> [B, W, H*hd]."""
    B, hd = q.shape[0], q.shape[-1]
    L = meta.kv_len
    if meta.kv_slots is not None:   # paged: the pools, read through the slot mapping
        kc, vc = k_cache, v_cache
    else:
        kc = k_cache[:B, :, :L]  # [B, Hkv, L, hd], a view
        vc = v_cache[:B, :, :L]
    return dispatch.attention(q, kc, vc, meta.mask, 1.0 / math.sqrt(hd), meta.grouped_mask, meta.kv_slots,
                              meta.visible_keys)


class MLP(nn.Module):
    """gate/up column-parallel and down row-parallel over `tp` (this rank's inter / N rows; the
    output all-reduced); whole without a group."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        inter //= tp.world if tp is not None else 1
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's addend of the output, before the all-reduce (the whole output without a group)."""
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The down projection's partial sums added over the ranks (as is without a group)."""
        return all_reduce(y, self.tp)


class Attention(nn.Module):
    """Self-attention with fused QKV, optional q/k RMSNorm (Qwen3) and QKV bias (Qwen2). Over `tp`,
    this rank's heads (`parallel.shard`): QKV column-parallel, o row-parallel (its output
    all-reduced)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        world, rank = (tp.world, tp.rank) if tp is not None else (1, 0)
        self.h, self.hkv = q_span(cfg, world, rank)[1], kv_heads_per_rank(cfg.num_kv_heads, world, rank)
        self.hd = cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, W, _ = qkv.shape
        q, k, v = qkv.split([self.h * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        return q.view(B, W, self.h, self.hd), k.view(B, W, self.hkv, self.hd), v.view(B, W, self.hkv, self.hd)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (q/k-normed where the model has it, no rope yet) and v."""
        return self.split_qkv(self.qkv_proj(x))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`project` from the fused QKV projection's output."""
        q, k, v = self._split(qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttnMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.from_qkv(self.qkv_proj(x), rope, meta, k_cache, v_cache)

    def from_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttnMeta,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The attention output (o-projected, summed over the ranks) from the fused QKV projection's output."""
        return self.reduce(self.o_proj(self.attend_qkv(qkv, rope, meta, k_cache, v_cache)))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The o projection's partial sums added over the ranks (as is without a group)."""
        return all_reduce(y, self.tp)

    def attend_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttnMeta,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """`from_qkv` before the o projection: [B, W, H*hd]."""
        norm = self.q_norm is not None
        qw, kw = (self.q_norm.weight, self.k_norm.weight) if norm else (None, None)
        eps = self.q_norm.eps if norm else 0.0
        B, W, _ = qkv.shape
        if dispatch.rope_in_attention(qkv, self.hd, self.h // self.hkv):   # a decode token
            L = meta.kv_len
            r = dispatch.Rope(qw, kw, eps, *rope, meta.slots, meta.positions)
            paged = meta.kv_slots is not None
            k, v = (k_cache, v_cache) if paged else (k_cache[:B, :, :L], v_cache[:B, :, :L])
            out = dispatch.rope_attention(qkv, self.h, k, v, meta.mask, 1.0 / math.sqrt(self.hd), r, meta.kv_slots)
            return out.view(B, W, self.h * self.hd)
        q = dispatch.qk_rope_write_kv(qkv, self.h, self.hkv, qw, kw, eps, *rope, k_cache, v_cache, meta.rows,
                                      meta.slots)
        return attend(q, meta, k_cache, v_cache)
