"""Routed experts with int4 weights kept packed (W4A16): `moe_kernel`'s two grouped GEMMs over the
(token, k) pairs laid out by expert (`moe_align`), each program unpacking its expert's words in
registers as `int4_kernel`'s tiles do.

gate_up [E, 2I, D / 8] with scales [E, 2I, D / G], down [E, D, I / 8] with scales [E, D, I / G]
(`int4_ops`' layout, experts stacked). `_gate_up_kernel` takes one tile of BM pair slots, all of
one expert, and BN of its gate rows with the matching up rows: the tile's token rows of x against
each plane of the packed words, silu(gate) · up per slot. `_down_kernel` multiplies those by the
expert's down rows, scales each pair by its combine weight and writes the pair's own row of
[N · k, D]; the k rows of a token are summed in order (no atomics). Rounded where
`int4_ops.experts` rounds: the weights, gate and up, silu, their product, the expert's output, the
combine weight and the weighted output. Sizes depend on N, k and the weights' shapes only, nothing
is read back: a forward can be captured in a CUDA graph.

One token (a decode) takes GEMVs instead, as `int4_kernel`'s one row does: its k pairs name k
different experts, so the tiles would have one live slot of 16 and, spanning the whole reduction
with 64 weight rows each, keep 32 programs of a hit expert busy on 132 SMs (156–165 µs against
a 5.2 µs floor for Kimi K2's expert on an H200; the GEMVs take 39 µs). A GEMV program takes one
pair and BN weight rows, so a hit expert spreads over I / BN (gate/up) and D / BN (down)
programs; no layout is needed, and pairs of id E return at once (down writes their zero rows).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from drafttree.kernels import int4_ops, moe_align
from drafttree.kernels.gemm_kernel import glu_out
from drafttree.kernels.int4_kernel import NIBBLE, GemvBlocks, check_group, load_step, plane, scaled, step_words
from drafttree.kernels.triton_jit import cdiv, interpreting, jit_kernel, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()


class Blocks(NamedTuple):
    bm: int        # pair slots per tile (the MMA's N; at least 16)
    bn_up: int     # gate (and as many up) weight rows per gate/up program (the MMA's M)
    bn_down: int   # down weight rows (output columns) per down program
    bkw: int       # packed words per step (at least 16, and at least a group)
    warps: int
    stages: int    # steps in flight


def blocks_for(pairs: int, num_experts: int) -> Blocks:
    """Tiles sized to the mean pairs per expert hit, as `moe_kernel.blocks_for`: 16 slots while most
    experts get a few pairs (decode, draft, verify: Kimi K2's DDTree verify of 33 rows, or 16 of
    them, puts one to eleven pairs on each of a rank's experts), more where a prefill chunk fills
    them. 64 weight rows a program are one warpgroup MMA on Hopper: fewer than 16 a warp would
    have warps repeat each other's unpacking. Chosen by the instructions a weight of the sm_90
    build's loops (4.1 to 4.2 at 16 slots), not timed on a GPU yet (`benchmarks/w4a16_bench.py
    --sweep`)."""
    per_expert = pairs / min(num_experts, pairs)
    if per_expert <= 16:
        return Blocks(16, 64, 128, 64, 4, 3)
    if per_expert <= 32:
        return Blocks(32, 64, 128, 32, 4, 3)
    if per_expert <= 64:
        return Blocks(64, 64, 128, 32, 4, 3)
    return Blocks(128, 128, 256, 16, 8, 3)


# One token's pairs: BN weight rows a program. Whether one token takes the GEMVs: the tiles
# remain for the bench to time against them.
GEMV = GemvBlocks(16, 128, 4, 3)
GEMV_ONE_TOKEN = True


def _gate_up_gemv_kernel(x_ptr, p_ptr, s_ptr, ids_ptr, h_ptr, nib, E: tl.constexpr, TOPK: tl.constexpr,
                         D: tl.constexpr, I: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                         BKW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    KW: tl.constexpr = D // 8
    KG: tl.constexpr = D // G
    WPG: tl.constexpr = G // 8
    BG: tl.constexpr = BKW // WPG
    q, nb = tl.program_id(0), tl.program_id(1)
    pdl_wait(PDL)   # the pair's expert is an earlier kernel's output
    e = tl.load(ids_ptr + q)
    if e >= E:
        return
    dt = h_ptr.dtype.element_ty
    x_row = x_ptr + (q // TOPK).to(tl.int64) * D
    n = nb * BN + tl.arange(0, BN)
    pw = p_ptr + e.to(tl.int64) * (2 * I * KW)
    sw = s_ptr + e.to(tl.int64) * (2 * I * KG)
    gate = tl.zeros([BN, BG, WPG], tl.float32)   # summed across lanes once, after the loop
    up = tl.zeros([BN, BG, WPG], tl.float32)
    for g0 in tl.range(0, KG, BG, num_stages=STAGES):
        g = g0 + tl.arange(0, BG)
        wg, hg, sg = load_step(pw, sw, n, g, I, KW, KG, WPG)
        wu, hu, su = load_step(pw + I * KW, sw + I * KG, n, g, I, KW, KG, WPG)
        xw = (g[:, None] * WPG + tl.arange(0, WPG)[None, :]) * 8   # [BG, WPG]: each word's first input
        x_ok = g[:, None] < KG
        pg = tl.zeros([BN, BG, WPG], tl.float32)   # each word's eight products, unscaled
        pu = tl.zeros([BN, BG, WPG], tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_row + xw + i, mask=x_ok, other=0.0).to(tl.float32)[None, :, :]
            pg += plane(wg, hg, i, nib) * xi
            pu += plane(wu, hu, i, nib) * xi
        gate += pg * sg.to(tl.float32)
        up += pu * su.to(tl.float32)
    h = glu_out(tl.sum(tl.sum(gate, axis=2), axis=1), tl.sum(tl.sum(up, axis=2), axis=1), dt)
    tl.store(h_ptr + q.to(tl.int64) * I + n, h.to(dt), mask=n < I)


def _down_gemv_kernel(h_ptr, p_ptr, s_ptr, ids_ptr, cw_ptr, y_ptr, nib, E: tl.constexpr, D: tl.constexpr,
                      I: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                      STAGES: tl.constexpr, PDL: tl.constexpr):
    KW: tl.constexpr = I // 8
    KG: tl.constexpr = I // G
    WPG: tl.constexpr = G // 8
    BG: tl.constexpr = BKW // WPG
    q, nb = tl.program_id(0), tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    n = nb * BN + tl.arange(0, BN)
    y_at = y_ptr + q.to(tl.int64) * D + n
    pdl_wait(PDL)
    e = tl.load(ids_ptr + q)
    if e >= E:   # another rank's expert: a zero row, so that the sum over k skips it
        tl.store(y_at, tl.zeros([BN], tl.float32).to(dt), mask=n < D)
        return
    h_row = h_ptr + q.to(tl.int64) * I
    pw = p_ptr + e.to(tl.int64) * (D * KW)
    sw = s_ptr + e.to(tl.int64) * (D * KG)
    acc = tl.zeros([BN, BG, WPG], tl.float32)
    for g0 in tl.range(0, KG, BG, num_stages=STAGES):
        g = g0 + tl.arange(0, BG)
        wd, hd, sd = load_step(pw, sw, n, g, D, KW, KG, WPG)
        hw = (g[:, None] * WPG + tl.arange(0, WPG)[None, :]) * 8
        h_ok = g[:, None] < KG
        part = tl.zeros([BN, BG, WPG], tl.float32)
        for i in tl.static_range(8):
            hv = tl.load(h_row + hw + i, mask=h_ok, other=0.0).to(tl.float32)[None, :, :]
            part += plane(wd, hd, i, nib) * hv
        acc += part * sd.to(tl.float32)
    # rounded where the torch forms round: the expert's output, the weight, their product
    cw = tl.load(cw_ptr + q).to(dt).to(tl.float32)
    y = tl.sum(tl.sum(acc, axis=2), axis=1).to(dt).to(tl.float32) * cw
    tl.store(y_at, y.to(dt), mask=n < D)


def _gate_up_kernel(x_ptr, p_ptr, s_ptr, pairs_ptr, tiles_ptr, h_ptr, P, nib, E: tl.constexpr,
                    TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, G: tl.constexpr,
                    SCALE_DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                    STAGES: tl.constexpr, PDL: tl.constexpr):
    KW: tl.constexpr = D // 8
    KG: tl.constexpr = D // G
    WPG: tl.constexpr = G // 8
    BG: tl.constexpr = BKW // WPG
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
    pw = p_ptr + e.to(tl.int64) * (2 * I * KW)
    sw = s_ptr + e.to(tl.int64) * (2 * I * KG)
    # transposed, [BN, BM]: the weight rows are the MMA's M, as a tile has few pairs
    gate = tl.zeros([BN, BM], tl.float32)
    up = tl.zeros([BN, BM], tl.float32)
    for g0 in tl.range(0, KG, BG, num_stages=STAGES):
        g = g0 + tl.arange(0, BG)
        wg, hg, sg = load_step(pw, sw, n, g, I, KW, KG, WPG)
        wu, hu, su = load_step(pw + I * KW, sw + I * KG, n, g, I, KW, KG, WPG)
        j = g0 * WPG + tl.arange(0, BKW)
        x_at = x_ptr + tok[None, :] * D + j[:, None] * 8
        x_ok = ok[None, :] & (j[:, None] < KW)
        for i in tl.static_range(8):
            xi = tl.load(x_at + i, mask=x_ok, other=0.0)   # [BKW, BM]: input 8j + i of each slot's token
            gate = tl.dot(scaled(plane(wg, hg, i, nib), sg, dt, SCALE_DT, BN, BKW), xi, gate, input_precision="ieee")
            up = tl.dot(scaled(plane(wu, hu, i, nib), su, dt, SCALE_DT, BN, BKW), xi, up, input_precision="ieee")
    h = glu_out(gate, up, dt)
    tl.store(h_ptr + slots[None, :].to(tl.int64) * I + n[:, None], h.to(dt), mask=ok[None, :] & (n[:, None] < I))


def _down_kernel(h_ptr, p_ptr, s_ptr, pairs_ptr, tiles_ptr, cw_ptr, y_ptr, P, nib, E: tl.constexpr,
                 D: tl.constexpr, I: tl.constexpr, G: tl.constexpr, SCALE_DT: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BKW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    KW: tl.constexpr = I // 8
    KG: tl.constexpr = I // G
    WPG: tl.constexpr = G // 8
    BG: tl.constexpr = BKW // WPG
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
    pw = p_ptr + e.to(tl.int64) * (D * KW)
    sw = s_ptr + e.to(tl.int64) * (D * KG)
    acc = tl.zeros([BN, BM], tl.float32)
    for g0 in tl.range(0, KG, BG, num_stages=STAGES):
        wd, hd, sd = load_step(pw, sw, n, g0 + tl.arange(0, BG), D, KW, KG, WPG)
        j = g0 * WPG + tl.arange(0, BKW)
        h_at = h_ptr + slots[None, :].to(tl.int64) * I + j[:, None] * 8
        h_ok = ok[None, :] & (j[:, None] < KW)
        for i in tl.static_range(8):
            hv = tl.load(h_at + i, mask=h_ok, other=0.0)
            acc = tl.dot(scaled(plane(wd, hd, i, nib), sd, dt, SCALE_DT, BN, BKW), hv, acc, input_precision="ieee")
    # rounded where the torch forms round: the expert's output, the weight, their product
    cw = tl.load(cw_ptr + pair, mask=ok, other=0.0).to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * cw[None, :]
    row = tl.where(ok, pair, 0).to(tl.int64)
    tl.store(y_ptr + row[None, :] * D + n[:, None], y.to(dt), mask=ok[None, :] & (n[:, None] < D))


def check(x: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
          down: torch.Tensor, down_scale: torch.Tensor, group_size: int) -> tuple[int, int, int]:
    """(E, D, I) of int4 experts for x [N, D] and ids [N, k]; a ValueError naming what disagrees."""
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"int4 experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not "
                         "stacked [E, rows, words]")
    E, two_i = gate_up.shape[:2]
    D, I = x.shape[-1], two_i // 2
    if two_i % 2 or tuple(down.shape[:2]) != (E, D) or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"int4 experts: x {tuple(x.shape)}, ids {tuple(idx.shape)}, gate_up {tuple(gate_up.shape)}"
                         f" and down {tuple(down.shape)} disagree (gate_up [E, 2I, D / 8], down [E, D, I / 8])")
    check_group(group_size, D)
    check_group(group_size, I)
    int4_ops.check_layout(gate_up, gate_up_scale, group_size, D)
    int4_ops.check_layout(down, down_scale, group_size, I)
    return E, D, I


def fused_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, group_size: int,
                  blocks: Blocks | GemvBlocks | None = None, dropless: bool = True) -> torch.Tensor:
    """Σ_k w[n, k] · expert_idx[n, k](x[n]) for x [N, D], w [N, k], idx [N, k] (ids in [0, E); with
    dropless=False also E: a pair that adds nothing and is not computed), int4 experts gate_up
    [E, 2I, D / 8] (+ scales [E, 2I, D / G]) and down [E, D, I / 8] (+ scales [E, D, I / G]).
    -> [N, D] in x's dtype. One token takes the GEMVs where GEMV_ONE_TOKEN; `blocks` (GemvBlocks
    for the GEMVs at one token, Blocks for the tiles at any) overrides the tables."""
    E, D, I = check(x, idx, gate_up, gate_up_scale, down, down_scale, group_size)
    N, k = idx.shape
    P = N * k
    if P == 0:
        return torch.zeros(N, D, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    gate_up, gate_up_scale = gate_up.contiguous(), gate_up_scale.contiguous()
    down, down_scale = down.contiguous(), down_scale.contiguous()
    cw = w.reshape(-1).float().contiguous()
    pdl = pdl_options(x.device)
    if N == 1 and (isinstance(blocks, GemvBlocks) or (blocks is None and GEMV_ONE_TOKEN)):
        # a program per (pair, BN weight rows); pairs of id E write zero rows
        g = blocks if isinstance(blocks, GemvBlocks) else GEMV
        ids = idx.reshape(-1).contiguous()
        h = torch.empty(P, I, dtype=x.dtype, device=x.device)
        y = torch.empty(P, D, dtype=x.dtype, device=x.device)
        common = dict(E=E, D=D, I=I, G=group_size, BN=g.bn, BKW=step_words(g.bkw, group_size), STAGES=g.stages,
                      num_warps=g.warps, **pdl)
        jit_kernel(_gate_up_gemv_kernel, interpreting(), ("nib",))[(P, cdiv(I, g.bn))](
            x, gate_up, gate_up_scale, ids, h, NIBBLE, TOPK=k, **common)
        jit_kernel(_down_gemv_kernel, interpreting(), ("nib",))[(P, cdiv(D, g.bn))](
            h, down, down_scale, ids, cw, y, NIBBLE, **common)
        return y.view(N, k, D).sum(dim=1)
    b = blocks if isinstance(blocks, Blocks) else blocks_for(P, E)
    lay = moe_align.layout(idx, E, b.bm)
    T = lay.tile_expert.numel()
    h = torch.empty(T * b.bm, I, dtype=x.dtype, device=x.device)
    # a pair with no slot (id E) is never written: zeros, so that the sum over k skips it
    y = (torch.empty if dropless else torch.zeros)(P, D, dtype=x.dtype, device=x.device)
    jit_kernel(_gate_up_kernel, interpreting(), ("P", "nib"))[(T, cdiv(I, b.bn_up))](
        x, gate_up, gate_up_scale, lay.pairs, lay.tile_expert, h, P, NIBBLE, E=E, TOPK=k, D=D, I=I, G=group_size,
        SCALE_DT=gate_up_scale.dtype == x.dtype, BM=b.bm, BN=b.bn_up, BKW=step_words(b.bkw, group_size),
        STAGES=b.stages, num_warps=b.warps, **pdl)
    jit_kernel(_down_kernel, interpreting(), ("P", "nib"))[(T, cdiv(D, b.bn_down))](
        h, down, down_scale, lay.pairs, lay.tile_expert, cw, y, P, NIBBLE, E=E, D=D, I=I, G=group_size,
        SCALE_DT=down_scale.dtype == x.dtype, BM=b.bm, BN=b.bn_down, BKW=step_words(b.bkw, group_size),
        STAGES=b.stages, num_warps=b.warps, **pdl)
    return y.view(N, k, D).sum(dim=1)
