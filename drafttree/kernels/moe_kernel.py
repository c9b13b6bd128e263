"""Routed experts as two grouped GEMMs over the (token, k) pairs laid out by expert (`moe_align`).

Each program takes one tile of BM pair slots, all of one expert, and BN of that expert's output
columns: `_gate_up_kernel` gathers the tile's token rows of x, multiplies them by the expert's
gate and up rows and writes silu(gate) · up per slot; `_down_kernel` multiplies those by the
expert's down rows, scales each pair by its combine weight and writes it to the pair's own row
of [N · k, D]. The k rows of a token are then summed in order: no atomics, so the output does not
depend on how programs are scheduled. Tiles past the last real one (the layout's static bound)
return at once.

An expert's weights are read once per tile of its pairs (a decode: once per expert hit), where
`Experts.gathered` copies them per pair and `Experts.all_experts` reads all E. Sizes depend on
N, k and the weights' shapes only, so a forward can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from drafttree.kernels import moe_align
from drafttree.kernels.gemm_kernel import glu_out
from drafttree.kernels.triton_jit import cdiv, interpreting, jit_kernel, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()


class Blocks(NamedTuple):
    bm: int        # pair slots per tile (the MMA's N; at least 16)
    bn_up: int     # gate (and as many up) weight rows per gate/up program (the MMA's M)
    bn_down: int   # down weight rows (output columns) per down program
    bk: int        # inputs per step
    warps: int
    stages: int


def blocks_for(pairs: int, num_experts: int) -> Blocks:
    """Tiles sized to the mean pairs per expert hit: 16 slots while most experts get a few pairs
    (decode, draft, verify), more where a prefill chunk fills them. Not tuned on a GPU yet
    (`benchmarks/moe_kernel_bench.py --sweep` times candidates); these compile for sm_80 and
    sm_90 without register spills."""
    per_expert = pairs / min(num_experts, pairs)
    if per_expert <= 16:
        return Blocks(16, 32, 64, 128, 4, 4)
    if per_expert <= 32:
        return Blocks(32, 64, 64, 64, 8, 3)
    return Blocks(64, 64, 64, 64, 8, 3)


def _gate_up_kernel(x_ptr, w_ptr, pairs_ptr, tiles_ptr, h_ptr, P, E: tl.constexpr, TOPK: tl.constexpr,
                    D: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    STAGES: tl.constexpr, PDL: tl.constexpr):
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
    w = w_ptr + e.to(tl.int64) * (2 * I * D)
    # transposed, [BN, BM]: the weight rows are the MMA's M, as a tile has few pairs
    gate = tl.zeros([BN, BM], tl.float32)
    up = tl.zeros([BN, BM], tl.float32)
    for k0 in tl.range(0, D, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + tok[None, :] * D + k[:, None], mask=ok[None, :] & (k[:, None] < D), other=0.0)
        w_ok = (n[:, None] < I) & (k[None, :] < D)
        wg = tl.load(w + n[:, None] * D + k[None, :], mask=w_ok, other=0.0)         # [BN, BK]
        wu = tl.load(w + (I + n[:, None]) * D + k[None, :], mask=w_ok, other=0.0)
        gate = tl.dot(wg, xv, gate, input_precision="ieee")
        up = tl.dot(wu, xv, up, input_precision="ieee")
    h = glu_out(gate, up, dt)
    tl.store(h_ptr + slots[None, :] * I + n[:, None], h.to(dt), mask=ok[None, :] & (n[:, None] < I))


def _down_kernel(h_ptr, w_ptr, pairs_ptr, tiles_ptr, cw_ptr, y_ptr, P, E: tl.constexpr, D: tl.constexpr,
                 I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 PDL: tl.constexpr):
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
    w = w_ptr + e.to(tl.int64) * (D * I)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in tl.range(0, I, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        hv = tl.load(h_ptr + slots[None, :] * I + k[:, None], mask=ok[None, :] & (k[:, None] < I), other=0.0)
        wd = tl.load(w + n[:, None] * I + k[None, :], mask=(n[:, None] < D) & (k[None, :] < I), other=0.0)
        acc = tl.dot(wd, hv, acc, input_precision="ieee")
    # rounded where the torch forms round: the expert's output, the weight, their product
    cw = tl.load(cw_ptr + pair, mask=ok, other=0.0).to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * cw[None, :]
    row = tl.where(ok, pair, 0).to(tl.int64)
    tl.store(y_ptr + row[None, :] * D + n[:, None], y.to(dt), mask=ok[None, :] & (n[:, None] < D))


def fused_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, blocks: Blocks | None = None, dropless: bool = True) -> torch.Tensor:
    """Σ_k w[n, k] · expert_idx[n, k](x[n]) for x [N, D], w [N, k] (fp32), idx [N, k] (ids in
    [0, E); with dropless=False also E: a pair that adds nothing and is not computed); gate_up
    [E, 2I, D], down [E, D, I] (copied where not contiguous). -> [N, D] in x's dtype."""
    N, k = idx.shape
    E, two_i, D = gate_up.shape
    I, P = two_i // 2, N * k
    b = blocks or blocks_for(P, E)
    lay = moe_align.layout(idx, E, b.bm)
    T = lay.tile_expert.numel()
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    h = torch.empty(T * b.bm, I, dtype=x.dtype, device=x.device)
    # a pair with no slot (id E) is never written: zeros, so that the sum over k skips it
    y = (torch.empty if dropless else torch.zeros)(P, D, dtype=x.dtype, device=x.device)
    pdl = pdl_options(x.device)
    jit_kernel(_gate_up_kernel, interpreting(), ("P",))[(T, cdiv(I, b.bn_up))](
        x, gate_up, lay.pairs, lay.tile_expert, h, P, E=E, TOPK=k, D=D, I=I, BM=b.bm, BN=b.bn_up, BK=b.bk,
        STAGES=b.stages, num_warps=b.warps, **pdl)
    jit_kernel(_down_kernel, interpreting(), ("P",))[(T, cdiv(D, b.bn_down))](
        h, down, lay.pairs, lay.tile_expert, w.reshape(-1).float().contiguous(), y, P, E=E, D=D, I=I, BM=b.bm,
        BN=b.bn_down, BK=b.bk, STAGES=b.stages, num_warps=b.warps, **pdl)
    return y.view(N, k, D).sum(dim=1)
