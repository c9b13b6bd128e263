"""Can one Triton launch per projection serve a verify's rows (33 for DDTree at budget 32, 16 for
DFlash) as fast as what the verify runs now: cuBLAS plus the separate residual-add + RMSNorm
and SiLU·up launches (and cuBLAS's split-K reduce)? A prototype, timed per matrix of one layer
against exactly that path, each as a CUDA graph cycling over 8 weight copies (weights from HBM).

The kernel is the one-token GEMV's prologues (`models/gemv_kernel.py`) over a block of rows with
`tl.dot`: each program owns BN output features of all rows, reads its [BN, K] weight slab once,
and recomputes the rows' prologue from L2 (the residual add, the norm's sum of squares, or
silu(gate)·up); the norm's scale is applied to the accumulator at the end.

    python benchmarks/results/2026-11-30_h200_run11/rows_gemm_bench.py [--rows 33,16] [--bn 16,32,64] [--bk 64,128] [--warps 4]  (CUDA)
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from drafttree.bench.graph_timer import cycling, graphed_us, weight_copies
from drafttree.bench.shapes import SHAPES, projections
from drafttree.models.layers import add_rms_norm, silu_mul
from drafttree.triton_jit import interpreting, jit_kernel, next_pow2

tl: Any = None  # triton.language, bound by jit_kernel()


def _rows_kernel(x_ptr, d_ptr, g_ptr, w_ptr, xo_ptr, y_ptr, M, N, eps, K: tl.constexpr,
                 HAS_D: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    dt = y_ptr.dtype.element_ty
    m = tl.arange(0, BM)
    n = pid * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    width = 2 * K if SILU else K
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        ok = (m[:, None] < M) & (k[None, :] < K)
        at = m[:, None] * width + k[None, :]
        if SILU:   # x = [gate | up] per row
            gate = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + at, mask=ok, other=0.0).to(tl.float32)
            h = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt)
        else:
            v = tl.load(x_ptr + at, mask=ok, other=0.0)
            if HAS_D:   # the residual stream, rounded to the model dtype as the torch add does
                v = (v.to(tl.float32) + tl.load(d_ptr + at, mask=ok, other=0.0).to(tl.float32)).to(dt)
                if pid == 0:
                    tl.store(xo_ptr + at, v, mask=ok)
            h = v
            if NORM:
                vf = v.to(tl.float32)
                ss += tl.sum(vf * vf, axis=1)
                h = (tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :] * vf).to(dt)
        w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=(n[None, :] < N) & (k[:, None] < K), other=0.0)
        acc += tl.dot(h, w)
    if NORM:
        acc = acc / tl.sqrt(ss / K + eps)[:, None]
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(dt), mask=(m[:, None] < M) & (n[None, :] < N))


def rows_gemm(kind: str, x: torch.Tensor, w: torch.Tensor, delta: torch.Tensor | None = None,
              g: torch.Tensor | None = None, eps: float = 1e-6, bn: int = 32, bk: int = 128,
              warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """kind "norm": (x + delta, rmsnorm(x + delta) * g @ w.T); "silu": (x, silu(gate) * up @ w.T)
    for x = [gate | up]; "plain": (x, x @ w.T). x [M, width], w [N, K]."""
    N, K = w.shape
    M = x.shape[0]
    xo = torch.empty_like(x) if delta is not None else x
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    jit_kernel(_rows_kernel, interpreting(), ("M", "N"))[(-(-N // bn),)](
        x, delta if delta is not None else x, g if g is not None else x, w, xo, y, M, N, eps, K=K,
        HAS_D=delta is not None, NORM=kind == "norm", SILU=kind == "silu", BM=max(16, next_pow2(M)),
        BN=bn, BK=bk, num_warps=warps)
    return xo, y


def reference(kind: str, x: torch.Tensor, w: torch.Tensor, delta: torch.Tensor | None = None,
              g: torch.Tensor | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """What the verify runs now: the compiled add + RMSNorm or SiLU·up, then cuBLAS."""
    if kind == "norm":
        assert delta is not None and g is not None
        xo, h = add_rms_norm(x, delta, g, eps)
        return xo, F.linear(h, w)
    return x, F.linear(silu_mul(x) if kind == "silu" else x, w)


KINDS = {"qkv": "norm", "o": "plain", "gate_up": "norm", "down": "silu"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="33,16")
    ap.add_argument("--bn", default="16,32,64")
    ap.add_argument("--bk", default="64,128")
    ap.add_argument("--warps", default="4")
    a = ap.parse_args()
    blocks = [(int(n), int(k), int(w)) for n in a.bn.split(",") for k in a.bk.split(",") for w in a.warps.split(",")]
    cfg = SHAPES[a.shape][0]
    torch.manual_seed(0)
    print(f"{a.shape}, bf16, us per call; the current path (cuBLAS + separate launches) against the "
          "fused kernel at its fastest blocks (bn, bk, warps)")
    total: dict[int, list[float]] = {}
    for name, (N, K) in projections(cfg).items():
        kind = KINDS[name]
        ws = weight_copies(N, K)
        g = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
        for M in (int(r) for r in a.rows.split(",")):
            x = torch.randn(M, 2 * K if kind == "silu" else K, device="cuda", dtype=torch.bfloat16)
            d = torch.randn_like(x) if kind == "norm" else None
            gg = g if kind == "norm" else None
            ref_us = graphed_us(cycling(lambda w: reference(kind, x, w, d, gg), ws), n=48)
            want = reference(kind, x, ws[0], d, gg)[1].float()
            best = (float("inf"), blocks[0])
            for b in blocks:
                got = rows_gemm(kind, x, ws[0], d, gg, 1e-6, *b)[1].float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 0.02:
                    print(f"  {name} M={M} {b}: relative error {err:.3g}")
                    continue
                t = graphed_us(cycling(lambda w, b=b: rows_gemm(kind, x, w, d, gg, 1e-6, *b), ws), n=48)
                best = min(best, (t, b))
            t_ref, t_best = total.setdefault(M, [0.0, 0.0])
            total[M] = [t_ref + ref_us, t_best + best[0]]
            print(f"{name:8s} {M:3d} rows: current {ref_us:6.1f}   fused {best[0]:6.1f} at {best[1]}", flush=True)
        del ws
    for M, (t_ref, t_best) in total.items():
        print(f"layer    {M:3d} rows: current {t_ref:6.1f}   fused {t_best:6.1f}")


if __name__ == "__main__":
    main()
