"""Routed experts with e4m3 weights in scaled blocks (`fp8_block_ops`' layout) as the two grouped
GEMMs of `moe_kernel`, weight-only: the same layout (`moe_align`), programs, rounding points and
semantics, with each weight tile widened in registers and each input block's partial dot scaled
in fp32 (`fp8_block_kernel.scaled_step`).

gate_up [E, 2I, D] with scales [E, ceil(2I / bn), ceil(D / bk)] (gate row n and up row I + n take
their own block's scale), down [E, D, I] with [E, ceil(D / bn), ceil(I / bk)]. Sizes depend on N,
k and the weights' shapes only, and nothing is read back: a forward can be captured in a CUDA
graph.
"""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels import moe_align
from drafttree.kernels.fp8_block_kernel import check_operands, scaled_step, step_inputs
from drafttree.kernels.gemm_kernel import glu_out
from drafttree.kernels.moe_kernel import Blocks
from drafttree.kernels.triton_jit import cdiv, interpreting, jit_kernel, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

Block = tuple[int, int]


# By the mean pairs per expert hit, the first class it fits: (most, blocks). Not tuned on a GPU
# yet (`benchmarks/fp8_block_bench.py --sweep` times candidates). Compiled for sm_90
# (`tests/compile_fp8_blocks.py`) each takes at most 210 registers a thread, no spills: the
# widest tiles step 64 inputs at a time (128 took all 255 registers for gate/up).
TILE_BLOCKS: list[tuple[float, Blocks]] = [
    (16, Blocks(16, 32, 64, 128, 4, 4)),
    (32, Blocks(32, 64, 64, 128, 8, 3)),
    (128, Blocks(64, 64, 64, 128, 8, 3)),
    (float("inf"), Blocks(128, 64, 128, 64, 8, 3)),
]


def blocks_for(pairs: int, num_experts: int) -> Blocks:
    """Tiles sized to the mean pairs per expert hit, as `moe_kernel.blocks_for` (`TILE_BLOCKS`): 16
    slots while most experts get a few pairs (decode, draft, verify), wider tiles where a prefill
    fills them."""
    per_expert = pairs / min(num_experts, pairs)
    return next(b for most, b in TILE_BLOCKS if per_expert <= most)


def _gate_up_kernel(x_ptr, w_ptr, s_ptr, pairs_ptr, tiles_ptr, h_ptr, P, E: tl.constexpr, TOPK: tl.constexpr,
                    D: tl.constexpr, I: tl.constexpr, QN: tl.constexpr, QK: tl.constexpr, SN: tl.constexpr,
                    SK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                    PDL: tl.constexpr):
    t, nb = tl.program_id(0), tl.program_id(1)
    pdl_wait(PDL)   # the tile's expert is an earlier kernel's output: nothing to load before
    e = tl.load(tiles_ptr + t)
    if e >= E:
        return
    dt = h_ptr.dtype.element_ty
    slots = t * BM + tl.arange(0, BM)
    pair = tl.load(pairs_ptr + slots)
    ok = pair < P
    tok = tl.where(ok, pair // TOPK, 0).to(tl.int64)
    n = nb * BN + tl.arange(0, BN)
    n_ok = n < I
    w = w_ptr + e.to(tl.int64) * (2 * I * D)
    s = s_ptr + e.to(tl.int64) * (SN * SK)   # the expert's [SN, SK] scales
    sg_rows = s + (n // QN) * SK
    su_rows = s + ((I + n) // QN) * SK
    gate = tl.zeros([BN, BM], tl.float32)   # transposed: the weight rows are the MMA's M
    up = tl.zeros([BN, BM], tl.float32)
    for k0 in tl.range(0, D, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + tok[None, :] * D + k[:, None], mask=ok[None, :] & (k[:, None] < D), other=0.0)
        w_ok = n_ok[:, None] & (k[None, :] < D)
        wg = tl.load(w + n[:, None] * D + k[None, :], mask=w_ok, other=0.0)         # [BN, BK] e4m3
        wu = tl.load(w + (I + n[:, None]) * D + k[None, :], mask=w_ok, other=0.0)
        gate = scaled_step(gate, wg, xv, sg_rows, k0, n_ok, QK, SK)
        up = scaled_step(up, wu, xv, su_rows, k0, n_ok, QK, SK)
    h = glu_out(gate, up, dt)
    tl.store(h_ptr + slots.to(tl.int64)[None, :] * I + n[:, None], h.to(dt), mask=ok[None, :] & n_ok[:, None])


def _down_kernel(h_ptr, w_ptr, s_ptr, pairs_ptr, tiles_ptr, cw_ptr, y_ptr, P, E: tl.constexpr, D: tl.constexpr,
                 I: tl.constexpr, QN: tl.constexpr, QK: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    t, nb = tl.program_id(0), tl.program_id(1)
    pdl_wait(PDL)
    e = tl.load(tiles_ptr + t)
    if e >= E:
        return
    dt = y_ptr.dtype.element_ty
    slots = t * BM + tl.arange(0, BM)
    pair = tl.load(pairs_ptr + slots)
    ok = pair < P
    n = nb * BN + tl.arange(0, BN)
    n_ok = n < D
    w = w_ptr + e.to(tl.int64) * (D * I)
    s = s_ptr + e.to(tl.int64) * (SN * SK)
    s_rows = s + (n // QN) * SK
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in tl.range(0, I, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        hv = tl.load(h_ptr + slots.to(tl.int64)[None, :] * I + k[:, None], mask=ok[None, :] & (k[:, None] < I),
                     other=0.0)
        wd = tl.load(w + n[:, None] * I + k[None, :], mask=n_ok[:, None] & (k[None, :] < I), other=0.0)
        acc = scaled_step(acc, wd, hv, s_rows, k0, n_ok, QK, SK)
    # rounded where the torch forms round: the expert's output, the weight, their product
    cw = tl.load(cw_ptr + pair, mask=ok, other=0.0).to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * cw[None, :]
    row = tl.where(ok, pair, 0).to(tl.int64)
    tl.store(y_ptr + row[None, :] * D + n[:, None], y.to(dt), mask=ok[None, :] & n_ok[:, None])


def fused_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, block: Block,
                  blocks: Blocks | None = None, dropless: bool = True) -> torch.Tensor:
    """Σ_k w[n, k] · expert_idx[n, k](x[n]) for x [N, D] (16-bit or fp32), w [N, k], idx [N, k] (ids
    in [0, E); with dropless=False also E: a pair that adds nothing and is not computed); e4m3
    gate_up [E, 2I, D], down [E, D, I] and their scales in `block`s (module docstring). -> [N, D]
    in x's dtype; `blocks` override the code's (`blocks_for`; bk is clamped to a divisor of the
    scale block's width)."""
    check_operands(gate_up, gate_up_scale, block)
    check_operands(down, down_scale, block)
    N, k = idx.shape
    E, two_i, D = gate_up.shape
    I, P = two_i // 2, N * k
    if down.shape != (E, D, I) or two_i != 2 * I or x.shape != (N, D):
        raise ValueError(f"fp8 block experts: x {list(x.shape)}, idx {list(idx.shape)}, gate_up "
                         f"{list(gate_up.shape)} and down {list(down.shape)} do not fit together")
    b = blocks or blocks_for(P, E)
    bk = step_inputs(b.bk, block[1])
    lay = moe_align.layout(idx, E, b.bm)
    T = lay.tile_expert.numel()
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    gs, ds = gate_up_scale.float().contiguous(), down_scale.float().contiguous()
    h = torch.empty(T * b.bm, I, dtype=x.dtype, device=x.device)
    # a pair with no slot (id E) is never written: zeros, so that the sum over k skips it
    y = (torch.empty if dropless else torch.zeros)(P, D, dtype=x.dtype, device=x.device)
    pdl = pdl_options(x.device)
    jit_kernel(_gate_up_kernel, interpreting(), ("P",))[(T, cdiv(I, b.bn_up))](
        x, gate_up, gs, lay.pairs, lay.tile_expert, h, P, E=E, TOPK=k, D=D, I=I, QN=block[0], QK=block[1],
        SN=gs.shape[1], SK=gs.shape[2], BM=b.bm, BN=b.bn_up, BK=bk, STAGES=b.stages, num_warps=b.warps, **pdl)
    jit_kernel(_down_kernel, interpreting(), ("P",))[(T, cdiv(D, b.bn_down))](
        h, down, ds, lay.pairs, lay.tile_expert, w.reshape(-1).float().contiguous(), y, P, E=E, D=D, I=I,
        QN=block[0], QK=block[1], SN=ds.shape[1], SK=ds.shape[2], BM=b.bm, BN=b.bn_down, BK=bk, STAGES=b.stages, num_warps=b.warps, **pdl)
    return y.view(N, k, D).sum(dim=1)
