"""A split-K GEMV in Triton for the few-row projections of decode (y = x Wᵀ + b, x [M ≤ 16, K]),
opt-in with DRAFTTREE_GEMV=1 while it is measured against cuBLAS (benchmarks/gemv_bench.py).

Two launches: programs over (column block, K split) write fp32 partials; a second sums the
splits in a fixed order (so graph replays and eager calls agree bit for bit), adds the bias and
casts. Splits are sized for about TARGET_PROGRAMS programs.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from drafttree.triton_jit import dots_run_on, interpreting, jit_kernel, next_pow2

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

ENABLED = os.environ.get("DRAFTTREE_GEMV", "0") == "1"
MAX_ROWS = 16
BLOCK_N, BLOCK_K = 64, 128
TARGET_PROGRAMS = 528   # four waves of an H200's 132 SMs


def _gemv_kernel(x_ptr, w_ptr, ws_ptr, M, N, K, sxm, swn, K_SPLIT: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    pid_n, s = tl.program_id(0), tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        k = s * K_SPLIT + k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + m[:, None] * sxm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                     other=0.0)
        wk = tl.load(w_ptr + n[:, None].to(tl.int64) * swn + k[None, :],
                     mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.dot(xk, tl.trans(wk), input_precision=PREC)
    tl.store(ws_ptr + (s * BM + m[:, None]) * N + n[None, :], acc, mask=(m[:, None] < M) & (n[None, :] < N))


def _reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    ok = (m[:, None] < M) & (n[None, :] < N)
    acc = tl.zeros([BM, BN], tl.float32)
    for s in range(S):
        acc += tl.load(ws_ptr + (s * BM + m[:, None]) * N + n[None, :], mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


def usable(x: torch.Tensor) -> bool:
    """Whether `linear` takes the kernel for x [..., K]: enabled, few rows, Triton there."""
    return ENABLED and x.numel() // x.shape[-1] <= MAX_ROWS and dots_run_on(x.device)


def plan_splits(N: int, K: int) -> int:
    """K splits so that column blocks x splits is about TARGET_PROGRAMS, each a whole BLOCK_K."""
    blocks = -(-N // BLOCK_N)
    return max(1, min(-(-TARGET_PROGRAMS // blocks), K // BLOCK_K))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] with at most MAX_ROWS rows."""
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1 or weight.stride(-1) != 1:
        x2, weight = x2.contiguous(), weight.contiguous()
    M = x2.shape[0]
    splits = plan_splits(N, K)
    k_split = -(-K // (splits * BLOCK_K)) * BLOCK_K
    splits = -(-K // k_split)
    ws = torch.empty(splits * MAX_ROWS * N, dtype=torch.float32, device=x.device)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    interpret = interpreting()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    jit_kernel(_gemv_kernel, interpret, ("M",))[(-(-N // BLOCK_N), splits)](
        x2, weight, ws, M, N, K, x2.stride(0), weight.stride(0), K_SPLIT=k_split, BM=MAX_ROWS,
        BN=BLOCK_N, BK=BLOCK_K, PREC=prec, num_warps=4, num_stages=4)
    jit_kernel(_reduce_kernel, interpret, ("M",))[(-(-N // BLOCK_N),)](
        ws, bias if bias is not None else y, y, M, N, S=splits, BM=MAX_ROWS, BN=BLOCK_N,
        HAS_BIAS=bias is not None, num_warps=4)
    return y.view(*lead, N)
