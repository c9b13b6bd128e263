"""Rotary tables of the MoE/MLA models: default, llama3 and yarn scaling over any rope width (MLA
ropes only qk_rope_head_dim of each head), with yarn's attention factor on cos and sin."""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.models.layers import rope_cos_sin, rope_inv_freq
from drafttree.moe_config import yarn_mscale


def rope_dim(cfg: ModelConfig) -> int:
    return cfg.mla.qk_rope_head_dim if cfg.mla is not None else cfg.head_dim


def yarn_inv_freq(dim: int, base: float, rs: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], the factor on cos/sin) of yarn scaling, as its paper and
    DeepSeek's code define them (correction range floored/ceiled unless `truncate` is false)."""
    factor, old = float(rs["factor"]), int(rs["original_max_position_embeddings"])
    fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if rs.get("attention_factor") is not None:
        attn = float(rs["attention_factor"])
    elif mscale and mscale_all:
        attn = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    else:
        attn = yarn_mscale(factor)

    def corr(rot: float) -> float:
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr(fast), corr(slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1 - ramp     # share of the unscaled (extrapolated) frequency
    return (1 / (factor * pos)) * ramp + (1 / pos) * extra, attn


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    dim = rope_dim(cfg)
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type") == "yarn":
        return yarn_inv_freq(dim, cfg.rope_theta, rs)
    return rope_inv_freq(dataclasses.replace(cfg, head_dim=dim, mla=None)), 1.0


class ScaledRotary(nn.Module):
    """`layers.Rotary` over `rope_dim(cfg)`, cos and sin times yarn's attention factor."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv, self.attention_factor = rope_tables(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.attention_factor == 1.0:
            return rope_cos_sin(positions, self.inv_freq, dtype)
        cos, sin = rope_cos_sin(positions, self.inv_freq, torch.float32)
        return (cos * self.attention_factor).to(dtype), (sin * self.attention_factor).to(dtype)
