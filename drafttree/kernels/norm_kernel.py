"""A residual add and RMSNorm per token row, in one Triton launch whose sums do not depend on how
many rows it is given (deterministic mode's final norm: the fused projections carry the others).

One program per row sums the squares in blocks of BLOCK along the row, in one order; the
arithmetic is `torch_ops.add_rms_norm`'s: the sum rounded to the model dtype, fp32 statistics,
the normed row rounded to the model dtype before the weight's product.
"""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels.triton_jit import interpreting, jit_kernel, next_pow2, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

BLOCK = 1024   # elements of a row per step


def _add_rms_norm_kernel(x_ptr, d_ptr, g_ptr, xo_ptr, y_ptr, eps, D: tl.constexpr, BD: tl.constexpr,
                         HAS_D: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64) * D
    dt = y_ptr.dtype.element_ty
    ss = tl.zeros([BD], tl.float32)
    for k0 in tl.static_range(0, D, BD):
        k = k0 + tl.arange(0, BD)
        ok = k < D
        v = tl.load(x_ptr + row + k, mask=ok, other=0.0)
        if HAS_D:   # rounded to the model dtype, as the torch add
            v = (v.to(tl.float32) + tl.load(d_ptr + row + k, mask=ok, other=0.0).to(tl.float32)).to(dt)
            tl.store(xo_ptr + row + k, v, mask=ok)
        h = v.to(tl.float32)
        ss += h * h
    r = 1.0 / tl.sqrt(tl.sum(ss, 0) / D + eps)
    for k0 in tl.static_range(0, D, BD):
        k = k0 + tl.arange(0, BD)
        ok = k < D
        src = xo_ptr if HAS_D else x_ptr
        h = tl.load(src + row + k, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + k, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row + k, (g * (h * r).to(dt).to(tl.float32)).to(dt), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rmsnorm(x + delta) * weight) for x [..., D] (x itself and its norm without delta)."""
    D = x.shape[-1]
    x = x.contiguous()
    d = delta.contiguous() if delta is not None else x
    xo = torch.empty_like(x) if delta is not None else x
    y = torch.empty_like(x)
    rows = x.numel() // D
    if rows:
        jit_kernel(_add_rms_norm_kernel, interpreting())[(rows,)](
            x, d, weight.contiguous(), xo, y, eps, D=D, BD=min(BLOCK, next_pow2(D)), HAS_D=delta is not None,
            num_warps=4, **pdl_options(x.device))
    return xo, y
