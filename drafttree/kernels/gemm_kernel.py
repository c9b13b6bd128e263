"""Few-row projections (2 to MAX_ROWS token rows: a verify, a draft block) with the one-token
GEMVs' prologue and epilogue (`gemv_kernel`), on tensor cores.

A DDTree verify at budget 32 runs 33 rows per layer through cuBLAS, with a residual add + RMSNorm
launch before the QKV and gate/up projections and a SiLU·up launch after the gate/up one. Here,
as in the one-token kernels, each runs inside its projection: a program streams BN weight rows
against BM token rows (a power of two, at most 64, from L2; more rows take more programs),
multiplies by the norm's weight before the dot and by each row's 1/rms after it. With `split` > 1
the programs also split the inputs, write fp32 partial sums, and a second launch
(`_finish_kernel`) adds the splits in a fixed order and applies the epilogue: deterministic, no
atomics.

The normed input is rounded to the model dtype for the tensor-core dot (its 1/rms is not), and the
dot sums in another order than cuBLAS: 16-bit models only, like the GEMVs. A weight class without
blocks in BLOCKS keeps the torch ops (`dispatch` routes it to `torch_ops.projection`): on an H200
these tiles beat cuBLAS where cuBLAS pays a split-K reduce launch (the o and down projections of
Qwen3-8B's shape) and on small weights, where a projection's time is its launches and its latency.
"""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels import kernel_blocks
from drafttree.kernels.triton_jit import (cdiv, device_function, interpreting, jit_kernel, next_pow2, pdl_options,
                                         pdl_wait)

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

MAX_ROWS = 64
# Per kernel, (least weight elements, (weight rows per program, inputs per step, warps, pipeline
# stages, input splits, token rows per program, most token rows, input steps loaded before the
# PDL wait) or None), largest class first, as gemv_kernel.BLOCKS; more token rows than a class's
# most take the torch ops. None keeps the torch ops (cuBLAS, and the norm or SiLU·up launch) where
# this kernel did not beat them: on an H200 at 33 rows (`benchmarks/gemv_bench.py --rows 33`) the
# Qwen3-8B o and down projections won (13.2 against 14.1 µs, 29.6 against 30.1), QKV with its
# norm and gate/up with SiLU·up lost (23.7 against 20.7, 69.3 against 57.8). Under 2^22 elements
# (the SmolLM2-135M shape, 0.3 to 1.8 M; weights from HBM) every matrix won in programs of 16
# rows, 4 pipeline stages and 2 splits: 17.8 against 23.4 µs a layer. At 64 rows (a draft block
# or DFlash verify at batch 4) the default pair was slower with them, so they stop at 33 rows.
# 2^22 to 2^24 was not swept. Steps before the wait (one tile, loaded while the kernel before
# still runs; a power of two, clamped to a split's steps): the SmolLM2-shape DDTree round took
# 1.148-1.156 ms with 4, 1.155-1.168 with 2 and 1.189-1.192 with none; the Qwen3-8B shape's
# verify 5.50 ms with 1 against 5.10 with none (H200): its programs outnumber the SMs, and early
# loads compete with the kernel before for HBM.
Blocks = tuple[int, int, int, int, int, int, int, int]
# fp8 weights (`quant.Fp8Linear`: e4m3, a scale per weight row) always take these tiles, at any
# row count (the torch ops have no weight-only fp8 product); the most-rows field is not used. The
# fastest per Qwen3-8B drafter matrix at 16 rows on an H200 (`gemv_bench.py --fp8 --rows 16`;
# wider tiles, and the token rows as the MMA's M, lost): µs against bf16's torch ops, QKV + norm
# 21.0 / 26.8, o 11.0 / 13.6, gate/up 57.2 / 62.7, down 25.5 / 29.0, fc 40.0 / 44.8, LM head 204 / 302.
BLOCKS_FP8: dict[str, list[tuple[int, Blocks]]] = {
    "norm": [(0, (128, 128, 4, 3, 4, 16, 0, 0))],
    "plain": [(1 << 28, (64, 128, 4, 3, 1, 16, 0, 0)), (0, (64, 256, 4, 3, 4, 16, 0, 0))],
    "glu": [(0, (64, 128, 4, 3, 4, 16, 0, 0))],
}
# How the fp8 tiles multiply (the kernel's W8; 0 is 16-bit weights): "f16" dots (e4m3 -> f16 is one
# conversion per pair; bf16 inputs are exact in f16 but past its range, clamped, or below its
# normals), or "widen" e4m3 to the inputs' dtype (exact), which fp32 inputs always take. 16-bit
# inputs take FP8_DOT: the Qwen3-8B drafter's draft + tree took 0.92 ms with f16 dots, 1.06
# widened (H200). (`benchmarks/gemv_bench.py --fp8-dot widen` sets it to time the other way.)
FP8_DOTS = {"widen": 1, "f16": 2}
FP8_DOT = "f16"
FINISH_BLOCK = 256   # outputs per program of the launch that adds the input splits
BLOCKS: dict[str, list[tuple[int, Blocks | None]]] = {
    "norm": [(1 << 22, None), (0, (64, 64, 4, 4, 2, 16, 33, 4))],
    "plain": [(1 << 24, (64, 128, 4, 3, 4, 64, 64, 0)), (1 << 22, None), (1 << 19, (32, 128, 4, 4, 2, 16, 33, 4)),
              (0, (64, 128, 4, 4, 2, 16, 33, 4))],
    "glu": [(1 << 22, None), (0, (64, 64, 4, 4, 2, 16, 33, 4))],
}


# Deterministic mode (`settings.deterministic`): every row count takes these tiles, with blocks
# fixed per kernel and a split of the inputs fixed per weight shape, never per row count: a
# token's sums then run in one order whether it is projected alone (a decode), in a verify, a
# prefill chunk or beside other requests. (weight rows per program, inputs per step, warps,
# stages); the split (`invariant_split`) aims at INVARIANT_PROGRAMS programs for one token row.
INVARIANT_BLOCKS: dict[str, tuple[int, int, int, int]] = {
    "norm": (64, 64, 4, 4), "plain": (64, 128, 4, 4), "glu": (64, 64, 4, 4)}
INVARIANT_PROGRAMS = 264   # two waves of an H200's 132 SMs
# Token rows per program, by the forward's row count: a row's sums take the same input steps in a
# tile of 16, 64 or 128 rows, with the same bits (H200: every row of 2,048 at three weight shapes;
# test_deterministic checks rows alone against 70 together on the GPU), so a verify or a prefill
# chunk reads each weight tile once per 128 rows rather than once per 16. Triton's interpreter
# multiplies tiles with the host's BLAS, whose sums do depend on the tile's rows: it keeps 16. So
# do fp32 inputs: their wider tiles overflow an H200's shared memory, and only bf16 was shown equal.
INVARIANT_ROWS = (16, 64, 128)


def invariant_rows(M: int, dtype: torch.dtype) -> int:
    """Deterministic mode's token rows per program for a forward of M rows of `dtype`."""
    if interpreting() or dtype.itemsize > 2:
        return INVARIANT_ROWS[0]
    return next((bm for bm in INVARIANT_ROWS if M <= bm), INVARIANT_ROWS[-1])


def invariant_split(kind: str, N: int, K: int) -> int:
    """The input split of deterministic mode's tiles for a weight of N outputs (halved for GLU)
    and K inputs: a function of the weight's shape only."""
    bn, bk = INVARIANT_BLOCKS[kind][:2]
    return max(1, min(INVARIANT_PROGRAMS // cdiv(N, bn), K // bk))


@device_function
def glu_out(gate, up, dt):
    """silu(gate) * up of fp32 sums, rounded where the unfused ops round: gate and up, silu, product."""
    gate = gate.to(dt).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)


def blocks_for(kind: str, numel: int, table: kernel_blocks.Table | None = None) -> Any:
    """The blocks of weights of `numel` elements in `table` (this module's BLOCKS, with the
    settings' sweep file applied, unless given)."""
    return kernel_blocks.lookup(kernel_blocks.in_force(BLOCKS, one_row=False) if table is None else table, kind, numel)


def set_blocks(kind: str, numel: int, blocks: Any, split: bool = False,
               table: kernel_blocks.Table | None = None) -> None:
    """`kernel_blocks.assign` in `table` (this module's BLOCKS unless given)."""
    kernel_blocks.assign(BLOCKS if table is None else table, kind, numel, blocks, split)


def tiles_cover(kind: str, numel: int, rows: int) -> bool:
    """Whether 16-bit weights of `numel` elements have blocks, and those cover `rows` token rows
    (else the torch ops, where these tiles lost)."""
    blocks = blocks_for(kind, numel)
    return blocks is not None and rows <= blocks[6]


@device_function
def _tile_step(x_ptr, d_ptr, g_ptr, xo_ptr, k, w, w_up, acc, acc_up, m, M, pid, K: tl.constexpr,
               HAS_D: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, W8: tl.constexpr):
    """Inputs k [S] of token rows m against the weight tiles w (and w_up) [BN, S] the caller
    loaded; returns the sums and the step's squares [S, BM] (zeros without NORM)."""
    dt = xo_ptr.dtype.element_ty
    x_ok = (k[:, None] < K) & (m[None, :] < M)
    v = tl.load(x_ptr + m[None, :] * K + k[:, None], mask=x_ok, other=0.0)   # [S, BM]
    if HAS_D:   # the residual stream, rounded to the model dtype as the torch add does
        v = (v.to(tl.float32) + tl.load(d_ptr + m[None, :] * K + k[:, None], mask=x_ok,
                                        other=0.0).to(tl.float32)).to(dt)
        if pid == 0:
            tl.store(xo_ptr + m[None, :] * K + k[:, None], v, mask=x_ok)
    sq = tl.zeros(v.shape, tl.float32)
    if NORM:
        h = v.to(tl.float32)
        sq = h * h
        v = (tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)[:, None] * h).to(dt)
    if W8 == 2:   # FP8_DOTS["f16"]
        vh = tl.clamp(v.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        acc = tl.dot(w.to(tl.float16), vh, acc)
        if GLU:
            acc_up = tl.dot(w_up.to(tl.float16), vh, acc_up)
    else:   # 16-bit weights, or e4m3 widened to the inputs' dtype (exact)
        acc = tl.dot(w.to(dt), v, acc, input_precision="ieee")
        if GLU:
            acc_up = tl.dot(w_up.to(dt), v, acc_up, input_precision="ieee")
    return acc, acc_up, sq


@device_function
def _weight_tiles(w_ptr, n, k, N, K: tl.constexpr, GLU: tl.constexpr):
    """The weight rows n (and, GLU, their up rows N + n) at inputs k: [BN, S] each."""
    w_ok = (n[:, None] < N) & (k[None, :] < K)
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=w_ok, other=0.0)
    w_up = w
    if GLU:
        w_up = tl.load(w_ptr + (N + n[:, None]) * K + k[None, :], mask=w_ok, other=0.0)
    return w, w_up


def _gemm_kernel(x_ptr, d_ptr, g_ptr, w_ptr, b_ptr, sc_ptr, xo_ptr, y_ptr, ws_ptr, ss_ptr, M, N, eps,
                 K: tl.constexpr, HAS_D: tl.constexpr, HAS_B: tl.constexpr, NORM: tl.constexpr,
                 GLU: tl.constexpr, W8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
                 PRE: tl.constexpr, PDL: tl.constexpr):
    pid, pk = tl.program_id(0), tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    n = pid * BN + tl.arange(0, BN)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    acc = tl.zeros([BN, BM], tl.float32)    # y transposed: the weight rows are the MMA's M
    acc_up = tl.zeros([BN, BM], tl.float32)   # GLU: rows N + n of w, the up half
    ss = tl.zeros([BK, BM], tl.float32)   # per lane, summed across lanes once, after the loop
    ss_pre = tl.zeros([BM], tl.float32)
    if PRE > 0:   # the first PRE steps' weights, one tile, loaded before the wait: under PDL, while
        # the kernel before still runs (weights are no kernel's output)
        k = pk * KS + tl.arange(0, PRE * BK)
        w, w_up = _weight_tiles(w_ptr, n, k, N, K, GLU)
        pdl_wait(PDL)
        acc, acc_up, sq = _tile_step(x_ptr, d_ptr, g_ptr, xo_ptr, k, w, w_up, acc, acc_up, m, M, pid, K, HAS_D,
                                     NORM, GLU, W8)
        ss_pre = tl.sum(sq, axis=0)
    else:
        pdl_wait(PDL)
    for k0 in tl.range(PRE * BK, KS, BK, num_stages=STAGES):
        kb = pk * KS + k0 + tl.arange(0, BK)
        wb, wb_up = _weight_tiles(w_ptr, n, kb, N, K, GLU)
        acc, acc_up, sqb = _tile_step(x_ptr, d_ptr, g_ptr, xo_ptr, kb, wb, wb_up, acc, acc_up, m, M, pid, K,
                                      HAS_D, NORM, GLU, W8)
        ss += sqb
    if W8:   # each weight row's scale (gate row n and up row N + n have their own)
        acc = acc * tl.load(sc_ptr + n, mask=n < N, other=0.0)[:, None]
        if GLU:
            acc_up = acc_up * tl.load(sc_ptr + N + n, mask=n < N, other=0.0)[:, None]
    out_ok = (n[:, None] < N) & (m[None, :] < M)
    ss = tl.sum(ss, axis=0) + ss_pre
    if SPLIT > 1:   # fp32 partial sums [split, M, N (+ N for up)]; _finish_kernel adds them
        part = ws_ptr + pk * M * (2 * N if GLU else N) + m[None, :] * (2 * N if GLU else N) + n[:, None]
        tl.store(part, acc, mask=out_ok)
        if GLU:
            tl.store(part + N, acc_up, mask=out_ok)
        if NORM and pid == 0:
            tl.store(ss_ptr + pk * M + m, ss, mask=m < M)
    else:
        if NORM:
            rs = 1.0 / tl.sqrt(ss / K + eps)
            acc = acc * rs[None, :]
            acc_up = acc_up * rs[None, :]
        if HAS_B:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        if GLU:
            acc = glu_out(acc, acc_up, dt)
        tl.store(y_ptr + m[None, :] * N + n[:, None], acc.to(dt), mask=out_ok)


def _finish_kernel(ws_ptr, ss_ptr, b_ptr, y_ptr, M, N, eps, K: tl.constexpr, HAS_B: tl.constexpr,
                   NORM: tl.constexpr, GLU: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)
    row, pid = tl.program_id(0), tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    n = pid * BN + tl.arange(0, BN)
    width = 2 * N if GLU else N
    acc = tl.zeros([BN], tl.float32)
    up = tl.zeros([BN], tl.float32)
    ss = 0.0
    for s in tl.static_range(SPLIT):   # a fixed order: the same sums at every replay
        acc += tl.load(ws_ptr + (s * M + row) * width + n, mask=n < N, other=0.0)
        if GLU:
            up += tl.load(ws_ptr + (s * M + row) * width + N + n, mask=n < N, other=0.0)
        if NORM:
            ss += tl.load(ss_ptr + s * M + row)
    if NORM:
        rs = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * rs
        up = up * rs
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    if GLU:
        acc = glu_out(acc, up, dt)
    tl.store(y_ptr + row * N + n, acc.to(dt), mask=n < N)


def launch(kind: str, x: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor | None, eps: float,
           w: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor | None = None,
           invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv_kernel.launch` for x [..., K] of 2 to MAX_ROWS rows whose weight class has blocks that
    cover them (`tiles_cover`; checked by the caller); with `scale` (fp8 weights w, fp32 scale
    [rows of w]) any rows; `invariant` (deterministic mode): any rows, each summed as it would be
    alone (INVARIANT_BLOCKS)."""
    w8 = scale is not None
    K = w.shape[1]
    M = x.numel() // K
    x, d, xo, y = outputs(kind, x, delta, w)
    N = y.shape[-1]
    if invariant:
        bn, bk, warps, stages = INVARIANT_BLOCKS[kind]
        split, pre, bm = invariant_split(kind, N, K), 0, invariant_rows(M, x.dtype)
    else:
        blocks = blocks_for(kind, w.numel(), BLOCKS_FP8 if w8 else None)
        if not w8 and (blocks is None or M > blocks[6]):
            raise ValueError(f"{kind} tiles: no blocks for {w.numel()} weight elements at {M} rows")
        bn, bk, warps, stages, split, bm, _, pre = blocks
        bm = min(bm, max(16, next_pow2(M)))
    ks = cdiv(cdiv(K, max(1, split)), bk) * bk   # inputs per split, a multiple of bk
    split = cdiv(K, ks)
    pre = 1 << (min(pre, ks // bk).bit_length() - 1) if pre > 0 else 0
    dot = (FP8_DOTS["widen"] if x.dtype == torch.float32 else FP8_DOTS[FP8_DOT]) if w8 else 0
    glu, norm = kind == "glu", g is not None
    ws = torch.empty(split, M, 2 * N if glu else N, dtype=torch.float32, device=x.device) if split > 1 else y
    ss = torch.empty(split, M, dtype=torch.float32, device=x.device) if split > 1 and norm else y
    pdl = pdl_options(x.device)
    jit_kernel(_gemm_kernel, interpreting(), ("M", "N"))[(cdiv(N, bn), split, cdiv(M, bm))](
        x, d, g.contiguous() if norm else x, w, b if b is not None else w, scale if w8 else w, xo, y, ws, ss, M,
        N, eps, K=K, HAS_D=delta is not None, HAS_B=b is not None, NORM=norm, GLU=glu, W8=dot, BM=bm, BN=bn,
        BK=bk, KS=ks, SPLIT=split, STAGES=stages, PRE=pre, num_warps=warps, **pdl)
    if split > 1:
        finish_splits(ws, ss, b, w, y, eps, K, norm, glu, split, pdl)
    return xo, y


def finish_splits(ws: torch.Tensor, ss: torch.Tensor, b: torch.Tensor | None, w: torch.Tensor, y: torch.Tensor,
                  eps: float, K: int, norm: bool, glu: bool, split: int, pdl: dict[str, Any]) -> None:
    """Add the fp32 partial sums ws [split, M, N (x2 for GLU)] of an input split into y [M, N]
    (`_finish_kernel`); `w` stands in for a missing bias, `ss` for missing squares."""
    M, N = y.numel() // y.shape[-1], y.shape[-1]
    jit_kernel(_finish_kernel, interpreting(), ("M", "N"))[(M, cdiv(N, FINISH_BLOCK))](
        ws, ss, b if b is not None else w, y, M, N, eps, K=K, HAS_B=b is not None, NORM=norm, GLU=glu,
        SPLIT=split, BN=FINISH_BLOCK, num_warps=4, **pdl)


def outputs(kind: str, x: torch.Tensor, delta: torch.Tensor | None,
            w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's operands and outputs: x and delta contiguous (delta is x without one),
    the residual stream out (x itself without delta) and y [..., N], N halved for gate/up."""
    x = x.contiguous()
    xo = torch.empty_like(x) if delta is not None else x
    N = w.shape[0] // 2 if kind == "glu" else w.shape[0]
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    return x, delta.contiguous() if delta is not None else x, xo, y
