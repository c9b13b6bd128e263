"""One-token projections with their prologue in the same launch (opt-in: DRAFTTREE_GEMV=1).

A decode step of one token runs, per layer, a residual add + RMSNorm before the QKV and the
gate/up projections and SiLU·up before the down projection: three small launches beside three
weight reads. Here each prologue runs inside the projection's own kernel:

    norm_gemv(x, delta, g, eps, W, b) -> (x + delta, W · rmsnorm(x + delta) * g + b)
    silu_gemv(gu, W)                 -> W · (silu(gate) * up),  gu = [gate | up]

Every program streams its BLOCK_N weight rows against the whole input row (a few KiB, from L2),
summing the row's squares on the way: the norm's scale applies once, after the dot. The residual
stream (x + delta) rounds as the torch add does; the normed input is not rounded to the model
dtype before the dot, and the dot sums in fp32 in another order than cuBLAS. So only 16-bit
models take this path: fp32 keeps cuBLAS everywhere and stays token-for-token equal between
decode and verify. Not yet timed on a GPU: `benchmarks/h200_checks.sh decode`.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from drafttree.triton_jit import interpreting, jit_kernel, kernels_run_on

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

ENABLED = os.environ.get("DRAFTTREE_GEMV", "0") == "1"
BLOCK_N = 16    # weight rows per program: qkv of Qwen3-8B (6,144 rows) is 384 programs
BLOCK_K = 256


def _norm_gemv_kernel(x_ptr, d_ptr, g_ptr, w_ptr, b_ptr, xo_ptr, y_ptr, N, eps, K: tl.constexpr,
                      HAS_D: tl.constexpr, HAS_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    dt = xo_ptr.dtype.element_ty
    n = pid * BN + tl.arange(0, BN)
    ss = tl.zeros([BK], tl.float32)
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + k, mask=k < K, other=0.0)
        if HAS_D:   # the residual stream, rounded to the model dtype as the torch add does
            v = (v.to(tl.float32) + tl.load(d_ptr + k, mask=k < K, other=0.0).to(tl.float32)).to(dt)
        if pid == 0:
            tl.store(xo_ptr + k, v, mask=k < K)
        vf = v.to(tl.float32)
        ss += vf * vf
        h = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32) * vf
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    acc = acc / tl.sqrt(tl.sum(ss, axis=0) / K + eps)   # the norm's scale, once per row
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, acc.to(dt), mask=n < N)


def _silu_gemv_kernel(gu_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    dt = y_ptr.dtype.element_ty
    n = pid * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        gate = tl.load(gu_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + K + k, mask=k < K, other=0.0)
        # silu in fp32, rounded, then times up in the model dtype: F.silu(gate) * up
        a = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(tl.float32)).to(dt)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + n, acc.to(dt), mask=n < N)


def usable(x: torch.Tensor) -> bool:
    """Whether a forward over x [B, W, D] takes these kernels: enabled, one token, 16-bit."""
    return (ENABLED and x.shape[0] * x.shape[1] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and kernels_run_on(x.device))


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor, eps: float, w: torch.Tensor,
              b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, (rmsnorm(x + delta) * g) @ w.T + b) for x [..., K] of one row; w [N, K]."""
    K, N = x.shape[-1], w.shape[0]
    if x.numel() != K or w.shape[1] != K or not w.is_contiguous():
        raise ValueError(f"norm_gemv: x {tuple(x.shape)}, w {tuple(w.shape)} (one row, w contiguous)")
    xo = torch.empty_like(x)
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    x, g = x.contiguous(), g.contiguous()
    d = delta.contiguous() if delta is not None else x
    jit_kernel(_norm_gemv_kernel, interpreting(), ("N",))[(-(-N // BLOCK_N),)](
        x, d, g, w, b if b is not None else w, xo, y, N, eps, K=K, HAS_D=delta is not None,
        HAS_B=b is not None, BN=BLOCK_N, BK=BLOCK_K, num_warps=4)
    return (xo if delta is not None else x), y


def silu_gemv(gu: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ w.T for gu = [gate | up] [..., 2K] of one row; w [N, K]."""
    K, N = w.shape[1], w.shape[0]
    if gu.numel() != 2 * K or gu.shape[-1] != 2 * K or not w.is_contiguous():
        raise ValueError(f"silu_gemv: gu {tuple(gu.shape)}, w {tuple(w.shape)} (one row, w contiguous)")
    y = torch.empty(*gu.shape[:-1], N, dtype=gu.dtype, device=gu.device)
    jit_kernel(_silu_gemv_kernel, interpreting(), ("N",))[(-(-N // BLOCK_N),)](
        gu.contiguous(), w, y, N, K=K, BN=BLOCK_N, BK=BLOCK_K, num_warps=4)
    return y
