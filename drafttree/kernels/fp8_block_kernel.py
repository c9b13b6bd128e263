"""A linear layer over an e4m3 weight with one scale per block (`fp8_block_ops`' layout), weight-only
(W8A16): the weight stays fp8 in memory and is widened in registers, at any row count.

A program owns BN weight rows and BM token rows and steps through the inputs BK at a time, BK
dividing the scale block's width: each step's tile dot (e4m3 widened to the inputs' dtype, which
holds every e4m3 value exactly; fp32 sums) is multiplied by its rows' scales for that input block
and added to an fp32 accumulator, so a weight is never rounded after scaling (the torch form rounds
each dequantized weight to the model dtype). The weight rows are the MMA's M (the widened operand
sits in registers, the token rows come from shared memory), as in `gemm_kernel`. Programs run down
the token tiles of GROUP weight tiles before moving on, so a wave of a prefill's programs shares
its weight tiles in L2. Where the tiles alone leave SMs idle (few rows, few weight rows) the
programs also split the inputs into fp32 partial sums that `gemm_kernel.finish_splits` adds in a
fixed order: deterministic, no atomics.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from drafttree.kernels import fp8_block_ops
from drafttree.kernels.gemm_kernel import finish_splits
from drafttree.kernels.triton_jit import (cdiv, device_function, interpreting, jit_kernel, next_pow2, pdl_options,
                                         pdl_wait)

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

Block = fp8_block_ops.Block


class Blocks(NamedTuple):
    bn: int       # weight rows per program (the MMA's M)
    bm: int       # token rows per program (the MMA's N; at least 16)
    bk: int       # inputs per step (clamped to a divisor of the scale block's width)
    warps: int
    stages: int
    group: int    # weight tiles whose token tiles a run of programs covers before the next ones
    split: int    # input splits; 0: chosen from the programs the tiles give (`plan`)


# By the forward's row count, the first class it fits: (most rows, blocks). Not tuned on a GPU
# yet (`benchmarks/fp8_block_bench.py --sweep` times candidates). A program holds its [BN, BM]
# fp32 sums and a step's partial dot in registers, and its stages of [BN, BK] e4m3 and [BK, BM]
# 16-bit tiles in shared memory: compiled for sm_90 (`tests/compile_fp8_blocks.py`), at most 235
# registers a thread without spills and 130 KB.
ROW_BLOCKS: list[tuple[int, Blocks]] = [
    (16, Blocks(64, 16, 128, 4, 4, 8, 0)),
    (32, Blocks(64, 32, 128, 4, 4, 8, 0)),
    (64, Blocks(64, 64, 128, 4, 3, 8, 0)),
    (256, Blocks(128, 64, 128, 8, 3, 8, 0)),
    (1 << 62, Blocks(128, 128, 128, 8, 3, 8, 0)),
]
# Programs the automatic split aims at: two per SM of an H200, whose weight reads then overlap.
TARGET_PROGRAMS = 264
MIN_BK = 16   # tl.dot's least inner size


def blocks_for(rows: int) -> Blocks:
    """The code's blocks for a forward of `rows` token rows."""
    return next(b for most, b in ROW_BLOCKS if rows <= most)


def step_inputs(bk: int, block_k: int) -> int:
    """Inputs per step: the largest power of two up to `bk` that divides the scale block's width
    (a step then lies in one block, under one scale)."""
    if block_k % MIN_BK:
        raise ValueError(f"fp8 block kernels need a scale block width that is a multiple of {MIN_BK}, "
                         f"got {block_k}")
    step = 1 << (min(bk, block_k).bit_length() - 1)
    while block_k % step:
        step //= 2
    return max(step, MIN_BK)


class Plan(NamedTuple):
    bm: int      # token rows per program, clamped to the forward's
    bk: int      # inputs per step
    tiles: int   # programs per split
    split: int   # input splits (1: no partial sums)
    ks: int      # inputs per split, a multiple of bk


def plan(M: int, N: int, K: int, block: Block, blocks: Blocks) -> Plan:
    """How `linear` launches for M token rows and a weight [N, K]: blocks clamped to the forward
    and the scale blocks, and the input split (`blocks.split`, or enough programs for
    TARGET_PROGRAMS; never more than the steps)."""
    bk = step_inputs(blocks.bk, block[1])
    bm = min(blocks.bm, max(16, next_pow2(M)))
    tiles = cdiv(N, blocks.bn) * cdiv(M, bm)
    steps = cdiv(K, bk)
    split = max(1, min(blocks.split if blocks.split > 0 else cdiv(TARGET_PROGRAMS, tiles), steps))
    ks = cdiv(steps, split) * bk
    return Plan(bm, bk, tiles, cdiv(K, ks), ks)


def check_operands(w: torch.Tensor, scale_inv: torch.Tensor, block: Block) -> None:
    """Refuse what the kernels do not read: a weight that is not e4m3, a scale grid of another
    shape (`fp8_block_ops.check_layout`)."""
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 block weights must be float8_e4m3fn, got {w.dtype}")
    fp8_block_ops.check_layout(w, scale_inv, block)


@device_function
def scaled_step(acc, w, v, s_rows, k0, rows_ok, QK: tl.constexpr, SK: tl.constexpr):
    """acc + (w @ v) * the scale of each weight row's block at inputs k0: w [BN, BS] e4m3, v
    [BS, BM] in the model dtype, s_rows [BN] pointers to each row's SK scales."""
    part = tl.dot(w.to(v.dtype), v, input_precision="ieee")
    # a step past K (the last split's) has zero weights: any block's scale will do
    s = tl.load(s_rows + tl.minimum(k0 // QK, SK - 1), mask=rows_ok, other=0.0)
    return acc + part * s[:, None]


def _linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, M, N: tl.constexpr, K: tl.constexpr,
                   QN: tl.constexpr, QK: tl.constexpr, SK: tl.constexpr, HAS_B: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, TILES_N: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                   SPLIT: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    pid, pk = tl.program_id(0), tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    # runs of GROUP weight tiles: programs take each token tile of a run's weight tiles in turn
    tiles_m = (M + BM - 1) // BM
    run = pid // (GROUP * tiles_m)
    first_n = run * GROUP
    width = tl.minimum(TILES_N - first_n, GROUP)
    within = pid % (GROUP * tiles_m)
    pn = first_n + within % width
    pm = within // width
    n = pn * BN + tl.arange(0, BN)
    m = pm * BM + tl.arange(0, BM)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_cols = x_ptr + m.to(tl.int64)[None, :] * K
    s_rows = s_ptr + (n // QN) * SK
    acc = tl.zeros([BN, BM], tl.float32)    # y transposed
    pdl_wait(PDL)
    for k0 in tl.range(0, KS, BK, num_stages=STAGES):   # static bounds: the interpreter needs them
        kb = pk * KS + k0
        k = kb + tl.arange(0, BK)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = scaled_step(acc, w, v, s_rows, kb, n_ok, QK, SK)
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT > 1:   # fp32 partial sums [split, M, N]; finish_splits adds them
        rows = (pk * M + m).to(tl.int64)
        tl.store(ws_ptr + rows[None, :] * N + n[:, None], acc, mask=out_ok)
    else:
        if HAS_B:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + m.to(tl.int64)[None, :] * N + n[:, None], acc.to(dt), mask=out_ok)


def linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: Block,
           bias: torch.Tensor | None = None, blocks: Blocks | None = None) -> torch.Tensor:
    """x [..., K] (16-bit or fp32) @ W.T for the e4m3 weight W [N, K] with scale_inv [ceil(N / bn),
    ceil(K / bk)] per `block`, + bias [N] -> [..., N] in x's dtype; `blocks` override the code's
    (`blocks_for`)."""
    check_operands(w, scale_inv, block)
    N, K = w.shape
    if x.shape[-1] != K or bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"fp8 block linear: x has {x.shape[-1]} inputs and the bias "
                         f"{None if bias is None else list(bias.shape)} for a weight of {N} outputs, {K} inputs")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(*lead, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    b = blocks or blocks_for(M)
    bm, bk, tiles, split, ks = plan(M, N, K, block, b)
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    w, s = w.contiguous(), scale_inv.float().contiguous()
    bias = bias.contiguous() if bias is not None else None
    pdl = pdl_options(x.device)
    jit_kernel(_linear_kernel, interpreting(), ("M",))[(tiles, split)](
        x2, w, s, bias if bias is not None else s, y, ws, M, N=N, K=K, QN=block[0], QK=block[1], SK=s.shape[1],
        HAS_B=bias is not None and split == 1, BM=bm, BN=b.bn, TILES_N=cdiv(N, b.bn), BK=bk, KS=ks, SPLIT=split,
        GROUP=b.group, STAGES=b.stages, num_warps=b.warps, **pdl)
    if split > 1:
        finish_splits(ws, y, bias, s, y.view(M, N), 0.0, K, False, False, split, pdl)
    return y
