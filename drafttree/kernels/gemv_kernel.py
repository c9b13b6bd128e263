"""One-token projections with their prologue and epilogue in the same launch (16-bit models;
`settings.gemv` off, DRAFTTREE_GEMV=0, turns them off).

A decode step of one token runs, per layer, a residual add + RMSNorm before the QKV and the
gate/up projections and SiLU·up between the gate/up and down projections: three small launches
beside the weight reads. Here each runs inside a projection's own kernel (the calls are
`dispatch`'s):

    norm_gemv(x, delta, g, eps, W, b) -> (x + delta, W · rmsnorm(x + delta) * g + b)
    norm_glu_gemv(x, delta, g, eps, W) -> (x + delta, silu(gate) * up),
                                          [gate | up] = W · rmsnorm(x + delta) * g
    gemv(x, W, b)                    -> W · x + b   (the o and down projections: cuBLAS's split-K
                                                     reduce costs a second launch there)

Every program streams its few weight rows against the whole input row (a few KiB, from L2),
summing the row's squares on the way: the norm's scale applies once, after the dot. A gate/up
program owns gate rows n and up rows I + n, so SiLU·up is its epilogue, rounded where the unfused
ops round (gate and up, then silu, then the product). The residual stream (x + delta) rounds as
the torch add does; the normed input is not rounded to the model dtype before the dot, and the
dot sums in fp32 in another order than cuBLAS. So only 16-bit models take this path: fp32 keeps
cuBLAS everywhere and stays token-for-token equal between decode and verify. All three are one
Triton kernel (prologue and epilogue chosen at compile time); block shapes per kernel and weight
size: `benchmarks/gemv_bench.py` sweeps them on the GPU.

On Hopper or newer GPUs the layer's kernels launch as programmatic dependent launches
(`triton_jit.pdl_on`): a GEMV's programs start while the kernel before still runs, load their
first weight steps (BLOCKS' last field), and wait there for that kernel's outputs. The decode step
of Qwen3-8B's shape took 4.22–4.28 ms against 4.32–4.38 without (H200).

The same three calls take 2 to gemm_kernel.MAX_ROWS rows (a verify, a draft block): `dispatch`
sends those to `gemm_kernel`, tensor-core tiles with the same prologue and epilogue, or to the
torch ops for the weight classes and row counts where those tiles lost.
"""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels import gemm_kernel, kernel_blocks
from drafttree.kernels.gemm_kernel import glu_out
from drafttree.kernels.triton_jit import cdiv, device_function, interpreting, jit_kernel, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

# Per kernel, (least weight elements, (weight rows per program, input columns per step, warps,
# steps loaded before the PDL wait)), largest class first: a weight takes the first class it
# reaches (a gate/up program's rows are that many gate rows and as many up rows). The fastest of
# benchmarks/gemv_bench.py per Qwen3-8B matrix on an H200 (gate/up 101 M elements, QKV 25 M,
# o 17 M, down 50 M), below 4 M elements per SmolLM2-135M matrix with weights from HBM (its
# decode step 0.590 -> 0.537 ms against sweeps whose weights sat in L2). Pipeline stages
# (num_stages 1 or 3) made no difference. Steps before the wait: the fastest decode step per
# setting; a power of two, clamped to the whole steps of K.
Blocks = tuple[int, int, int, int]
BLOCKS: dict[str, list[tuple[int, Blocks]]] = {
    "norm": [(1 << 26, (8, 1024, 4, 1)), (1 << 22, (16, 512, 4, 1)), (0, (8, 512, 2, 1))],
    "plain": [(1 << 25, (8, 1024, 4, 2)), (1 << 22, (4, 1024, 8, 2)), (1 << 19, (2, 512, 2, 1)), (0, (2, 512, 4, 1))],
    "glu": [(1 << 22, (4, 1024, 4, 1)), (0, (2, 512, 4, 1))],
}


def blocks_for(kind: str, numel: int) -> Blocks:
    """The blocks of weights of `numel` elements (BLOCKS, with the settings' sweep file applied)."""
    return kernel_blocks.lookup(kernel_blocks.in_force(BLOCKS, one_row=True), kind, numel)


def set_blocks(kind: str, numel: int, blocks: Blocks, split: bool = False) -> None:
    kernel_blocks.assign(BLOCKS, kind, numel, blocks, split)


@device_function
def _gemv_step(x_ptr, d_ptr, g_ptr, xo_ptr, k, w, w_up, acc, acc_up, ss, pid, K: tl.constexpr,
               HAS_D: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, WIDE: tl.constexpr):
    """Inputs k [BK] against the weight tiles w (and w_up) [BN, BK] the caller loaded; WIDE: k
    [PRE, BK] and tiles [BN, PRE, BK], summed into the same [BN, BK] lanes."""
    v = tl.load(x_ptr + k, mask=k < K, other=0.0)
    if HAS_D:   # the residual stream, rounded to the model dtype as the torch add does
        v = (v.to(tl.float32) + tl.load(d_ptr + k, mask=k < K, other=0.0).to(tl.float32)).to(v.dtype)
        if pid == 0:
            tl.store(xo_ptr + k, v, mask=k < K)
    h = v.to(tl.float32)
    if NORM:
        if WIDE:
            ss += tl.sum(h * h, 0)
        else:
            ss += h * h
        h = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32) * h
    if WIDE:
        acc += tl.sum(w.to(tl.float32) * h[None, :, :], 1)
        if GLU:
            acc_up += tl.sum(w_up.to(tl.float32) * h[None, :, :], 1)
    else:
        acc += w.to(tl.float32) * h[None, :]
        if GLU:
            acc_up += w_up.to(tl.float32) * h[None, :]
    return acc, acc_up, ss


def _gemv_kernel(x_ptr, d_ptr, g_ptr, w_ptr, b_ptr, xo_ptr, y_ptr, N, eps, K: tl.constexpr,
                 HAS_D: tl.constexpr, HAS_B: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    dt = y_ptr.dtype.element_ty
    n = pid * BN + tl.arange(0, BN)
    ss = tl.zeros([BK], tl.float32)
    acc = tl.zeros([BN, BK], tl.float32)   # summed across lanes once, after the loop
    acc_up = tl.zeros([BN, BK], tl.float32)   # GLU: rows N + n of w, the up half
    # The first PRE steps' weights load before the wait: under PDL, while the kernel before runs.
    if PRE > 1:
        k = tl.arange(0, PRE)[:, None] * BK + tl.arange(0, BK)[None, :]
        w_at = n[:, None, None] * K + k[None, :, :]
        w_ok = (n[:, None, None] < N) & (k[None, :, :] < K)
    else:
        k = tl.arange(0, BK)
        w_at = n[:, None] * K + k[None, :]
        w_ok = (n[:, None] < N) & (k[None, :] < K)
    w = tl.load(w_ptr + w_at, mask=w_ok, other=0.0)
    w_up = w
    if GLU:
        w_up = tl.load(w_ptr + N * K + w_at, mask=w_ok, other=0.0)
    pdl_wait(PDL)
    acc, acc_up, ss = _gemv_step(x_ptr, d_ptr, g_ptr, xo_ptr, k, w, w_up, acc, acc_up, ss, pid, K, HAS_D,
                                 NORM, GLU, PRE > 1)
    for k0 in range(PRE * BK, K, BK):   # (new names: the first step's may be wider)
        kb = k0 + tl.arange(0, BK)
        wb_ok = (n[:, None] < N) & (kb[None, :] < K)
        wb = tl.load(w_ptr + n[:, None] * K + kb[None, :], mask=wb_ok, other=0.0)
        wb_up = wb
        if GLU:
            wb_up = tl.load(w_ptr + (N + n[:, None]) * K + kb[None, :], mask=wb_ok, other=0.0)
        acc, acc_up, ss = _gemv_step(x_ptr, d_ptr, g_ptr, xo_ptr, kb, wb, wb_up, acc, acc_up, ss, pid, K,
                                     HAS_D, NORM, GLU, False)
    acc = tl.sum(acc, axis=1)
    if NORM:
        acc = acc / tl.sqrt(tl.sum(ss, axis=0) / K + eps)   # the norm's scale, once per row
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    if GLU:   # silu(gate) * up, rounded where the unfused ops round: gate and up, silu, product
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
        acc = glu_out(acc, up, dt)
    tl.store(y_ptr + n, acc.to(dt), mask=n < N)


def check(kind: str, x: torch.Tensor, w: torch.Tensor, any_rows: bool = False) -> int:
    """The token rows of x [..., K] for a fused projection of kind `kind` by w [N, K] (at most
    gemm_kernel.MAX_ROWS unless `any_rows`); a ValueError where the kernels cannot take them."""
    N, K = w.shape
    rows = x.numel() // K
    most = None if any_rows else gemm_kernel.MAX_ROWS
    if x.shape[-1] != K or most is not None and rows > most or not w.is_contiguous() or kind == "glu" and N % 2:
        even = ", w's rows [gate | up]: an even count" if kind == "glu" else ""
        limit = "" if most is None else f"at most {most} rows, "
        raise ValueError(f"{kind} gemv: x {tuple(x.shape)}, w {tuple(w.shape)} ({limit}w contiguous{even})")
    return rows


def launch(kind: str, x: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor | None, eps: float,
           w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-token projection of kind "norm" (x + delta, (rmsnorm(x + delta) * g) @ w.T + b),
    "plain" (x @ w.T + b) or "glu" (x + delta, silu(gate) * up of the "norm" product, w [gate | up])
    for x [..., K] of one row (`check`ed by the caller), 16-bit w [N, K]: (residual stream, y)."""
    K = w.shape[1]
    x, d, xo, y = gemm_kernel.outputs(kind, x, delta, w)
    N = y.shape[-1]
    bn, bk, warps, pre = blocks_for(kind, w.numel())
    pre = max(1, min(pre, 1 << (max(K // bk, 1).bit_length() - 1)))
    jit_kernel(_gemv_kernel, interpreting(), ("N",))[(cdiv(N, bn),)](
        x, d, g.contiguous() if g is not None else x, w, b if b is not None else w, xo, y, N, eps, K=K,
        HAS_D=delta is not None, HAS_B=b is not None, NORM=g is not None, GLU=kind == "glu", BN=bn,
        BK=bk, PRE=pre, num_warps=warps, **pdl_options(x.device))
    return xo, y
