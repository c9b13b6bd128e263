"""The attention's pre-processing in one Triton launch per layer: from the fused QKV
projection's output, q and k per-head RMSNorm (Qwen3) and rope, q out, and k and v written
into the KV cache at their slots. In torch (compiled) this is two kernels for q and k and one
for the cache write. One-token decodes do the same work inside the attention's split launch
instead (`attn_kernel.rope_attention`, the same formulas); wider forwards take this kernel.

Arithmetic is fp32 with one rounding to the model dtype after the norm (as `torch_ops._rms_norm`)
and one at the store: graphs and eager CUDA rounds both run this kernel, so they agree; CPU
rounds keep the torch ops.
"""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels.triton_jit import device_function, interpreting, jit_kernel, next_pow2, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()


@device_function
def norm_rope(x, xr, w, wr, cos, sin, eps, HD: tl.constexpr, NORM: tl.constexpr):
    """Per-head RMSNorm (with NORM) and rope of rows x [R, HD] in the model dtype; xr holds the
    same rows at the rotated dims (d + HD/2) % HD, w and wr the norm weight at d and there (fp32).
    One rounding to the model dtype after the norm, as `torch_ops._rms_norm`; fp32 out."""
    dt = x.dtype
    x = x.to(tl.float32)
    xr = xr.to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 1) / HD + eps)[:, None]
        x = (x * r).to(dt).to(tl.float32) * w
        xr = (xr * r).to(dt).to(tl.float32) * wr
    sign = tl.where(tl.arange(0, HD) < HD // 2, -1.0, 1.0)[None, :]   # rotate_half: (-x2, x1)
    return x * cos + sign * xr * sin


def _qk_rope_kv_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, row_ptr,
                       slot_ptr, W, eps, kcr, kch, kcl, vcr, vch, vcl,
                       H: tl.constexpr, HKV: tl.constexpr, QK_PAD: tl.constexpr,
                       HKV_PAD: tl.constexpr, HD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)   # token (b, i), t = b * W + i
    b = t // W
    src = qkv_ptr + t.to(tl.int64) * (H + 2 * HKV) * HD
    d = tl.arange(0, HD)[None, :]
    d_rot = (d + HD // 2) % HD
    cos = tl.load(cos_ptr + t * HD + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * HD + d).to(tl.float32)
    # the H query heads and then the HKV key heads, as one [QK_PAD, HD] block
    h = tl.arange(0, QK_PAD)[:, None]
    ok = h < H + HKV
    is_q = h < H
    x = tl.load(src + h * HD + d, mask=ok, other=0.0)
    xr = tl.load(src + h * HD + d_rot, mask=ok, other=0.0)
    w, wr = cos, sin   # norm weights, read with NORM only
    if NORM:
        w = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
        wr = tl.where(is_q, tl.load(qw_ptr + d_rot), tl.load(kw_ptr + d_rot)).to(tl.float32)
    y = norm_rope(x, xr, w, wr, cos, sin, eps, HD, NORM)
    tl.store(q_ptr + (t.to(tl.int64) * H + h) * HD + d, y.to(q_ptr.dtype.element_ty), mask=ok & is_q)
    row = tl.load(row_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    tl.store(kc_ptr + row * kcr + (h - H) * kch + slot * kcl + d, y.to(kc_ptr.dtype.element_ty),
             mask=ok & ~is_q)
    hv = tl.arange(0, HKV_PAD)[:, None]
    v = tl.load(src + (H + HKV + hv) * HD + d, mask=hv < HKV)
    tl.store(vc_ptr + row * vcr + hv * vch + slot * vcl + d, v, mask=hv < HKV)


def qk_rope_write_kv(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """qkv [B, W, (H + 2 Hkv) * hd] -> q [B, W, H, hd], normed (if weights) and roped; k (normed,
    roped) and v go to cache[rows[b], :, slots[b, i]]. cos, sin [B, W, 1, hd]."""
    B, W, C = qkv.shape
    hd = C // (heads + 2 * kv_heads)
    q = torch.empty(B, W, heads, hd, dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None
    jit_kernel(_qk_rope_kv_kernel, interpreting(), ("W",))[(B * W,)](
        qkv.contiguous(), q_weight if norm else qkv, k_weight if norm else qkv, cos.contiguous(),
        sin.contiguous(), q, k_cache, v_cache, rows.reshape(B).contiguous(), slots.contiguous(), W, eps,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=heads, HKV=kv_heads, QK_PAD=next_pow2(heads + kv_heads), HKV_PAD=next_pow2(kv_heads), HD=hd,
        NORM=norm, num_warps=4, **pdl_options(qkv.device))
    return q
