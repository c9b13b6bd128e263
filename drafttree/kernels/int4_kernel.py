"""W4A16 projections: y = x @ W.T + b for 16-bit x [M, K] and an int4 weight W [N, K] kept packed
as compressed-tensors stores it (`int4_ops`: packed int32 [N, K / 8], scale [N, K / G]).

The weight is never widened in memory: a program loads packed words and their group scales (as
[rows, groups, words per group] and [rows, groups, 1] tiles, so that each scale is loaded once and
broadcast in registers) and unpacks them there. Word j of a row holds inputs 8j .. 8j + 7; the
kernels take them as eight planes, plane i being input 8j + i of every word j of the step, a mask
of the loaded words multiplied against the matching inputs of x (a strided load of x, which is
small and read from L2). So nothing reorders the weight's registers between the load and its use.
A nibble becomes its value without a shift or a conversion instruction: left at its bit p and
OR-ed into the mantissa of 2^(23 - p) it reads 2^(23 - p) + u, and one subtraction gives
q = u - 8 exactly (inputs 5..7 from the word shifted right by 12, so that no nibble reaches the
exponent). The nibble mask is a run-time 15 shifted: as immediates, ptxas rematerializes one of
each plane's two constants with a move per value.

    gemv   one token row: BN weight rows a program, each word's eight products summed unscaled
           in fp32 lanes, then times the group's scale; the lanes summed once, after the loop
    gemm   any rows: tiles of BN weight rows x BM token rows on tensor cores, the weight rows as
           the MMA's M (decode, draft and verify have few token rows); each step eight dots of
           BKW inputs, one per plane, the plane times its scales rounded to the model dtype
           first, as `int4_ops.dequantize` rounds the weight (a bf16 product where the scales
           are the model's dtype, else an fp32 one, rounded)

Both are weight-read bound at a decode's rows (the floor: packed words + scales over HBM
bandwidth; `benchmarks/w4a16_bench.py` times them against it). Group sizes: powers of two from 8
(whole packed words; compressed-tensors checkpoints use 32, Kimi K2.6, and 128) that divide K.
Blocks per row count: BLOCKS and GEMV, from instruction counts of the sm_90 build, not yet timed
on a GPU (`benchmarks/w4a16_bench.py --sweep` times candidates).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from drafttree.kernels import int4_ops
from drafttree.kernels.triton_jit import cdiv, device_function, interpreting, jit_kernel, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

NIBBLE = 0xF


class Blocks(NamedTuple):
    bm: int        # token rows per program (the MMA's N; at least 16)
    bn: int        # weight rows per program (the MMA's M; at least 16)
    bkw: int       # packed words per step (8 * bkw inputs; at least 16, and at least a group)
    warps: int
    stages: int    # steps in flight (the words and scales load asynchronously ahead)


class GemvBlocks(NamedTuple):
    bn: int        # weight rows per program
    bkw: int       # packed words per step (at least a group)
    warps: int
    stages: int


# (most token rows, blocks), fewest first; more rows than the last take the last. Chosen by the
# instructions a weight (per token row, for wide tiles) of the sm_90 build's loop, weighed against
# the programs a 7168-row output spreads over 132 SMs: 64 weight rows a program are one warpgroup
# MMA on Hopper (fewer would repeat the unpacking across warps) and keep a decode's 7168 outputs on
# 112 programs; a prefill chunk takes 128 x 256 tiles, whose unpacking then costs about what
# their MMAs do. Not timed on a GPU yet.
BLOCKS: list[tuple[int, Blocks]] = [
    (16, Blocks(16, 64, 64, 4, 3)),
    (32, Blocks(32, 64, 64, 4, 3)),
    (64, Blocks(64, 64, 32, 4, 3)),
    (256, Blocks(128, 128, 16, 8, 3)),
    (1 << 62, Blocks(128, 256, 16, 8, 3)),
]
GEMV = GemvBlocks(16, 128, 4, 3)
# Deterministic mode (`settings.deterministic`): every row count takes these tiles, never the GEMV,
# so a token row's sums run in one order alone (a decode), in a verify or in a prefill chunk.
INVARIANT_BLOCKS = Blocks(16, 64, 64, 4, 3)
# Whether one token row takes the GEMV (else the tiles at 16 rows). In the sm_90 build the GEMV's
# loop issues 4.4 instructions a weight, the tiles' 4.9: at one weight per 0.5 byte both issue
# near or past what HBM delivers, so the fewer instructions should win; the bench times both.
GEMV_ONE_ROW = True


def check_group(group_size: int, in_features: int) -> None:
    """Refuse a group size the kernels cannot take: a power of two of at least PACK inputs (whole
    packed words) that divides the inputs."""
    if group_size < int4_ops.PACK or group_size & (group_size - 1) or in_features % group_size:
        raise ValueError(f"int4 group size {group_size} for {in_features} inputs: supported are powers of two "
                         f"from {int4_ops.PACK} (32 and 128 among them) that divide the inputs")


def blocks_for(rows: int) -> Blocks:
    return next(b for most, b in BLOCKS if rows <= most)


def step_words(bkw: int, group_size: int) -> int:
    """Words per step: at least one whole group."""
    return max(bkw, group_size // int4_ops.PACK)


@device_function
def plane(words, high, i: tl.constexpr, nib):
    """The int4 values of input 8j + i of each packed word j (`high`: the words shifted right by
    12; `nib`: 15) as exact fp32: the nibble left at its bit p, OR-ed into the mantissa of
    2^(23 - p), minus 2^(23 - p) + 8."""
    if i < 5:
        src = words
        p: tl.constexpr = 4 * i
    else:
        src = high   # arithmetic shifts of negative words: the mask clears their sign bits
        p: tl.constexpr = 4 * i - 12
    bits = (src & (nib << p)) | ((150 - p) << 23)
    return bits.to(tl.float32, bitcast=True) - ((1 << (23 - p)) + 8.0)


@device_function
def load_step(p_ptr, s_ptr, n, g, N, KW: tl.constexpr, KG: tl.constexpr, WPG: tl.constexpr):
    """The packed words of weight rows n [BN] in groups g [BG], [BN, BG, WPG], the same shifted
    right by 12, and the groups' scales [BN, BG, 1] (fp32)."""
    n3 = n[:, None, None]
    g3 = g[None, :, None]
    ok = (n3 < N) & (g3 < KG)
    words = tl.load(p_ptr + n3 * KW + g3 * WPG + tl.arange(0, WPG)[None, None, :], mask=ok, other=0)
    scale = tl.load(s_ptr + n3 * KG + g3, mask=ok, other=0.0)
    return words, words >> 12, scale


@device_function
def scaled(q, scale, dt, SCALE_DT: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr):
    """A plane's values q [BN, BG, WPG] times their group scales [BN, BG, 1], as the [BN, BKW] tile
    of a dot in `dt`, rounded once (SCALE_DT: the scales are in `dt`, a product in `dt`; else in
    fp32, then rounded). Kernels call `plane` themselves: a device function calls no other."""
    if SCALE_DT:
        w = q.to(dt) * scale
    else:
        w = (q * scale.to(tl.float32)).to(dt)
    return tl.reshape(w, [BN, BKW])


def _gemv_kernel(x_ptr, p_ptr, s_ptr, b_ptr, y_ptr, N, nib, K: tl.constexpr, G: tl.constexpr,
                 HAS_B: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, STAGES: tl.constexpr,
                 PDL: tl.constexpr):
    KW: tl.constexpr = K // 8
    KG: tl.constexpr = K // G
    WPG: tl.constexpr = G // 8
    BG: tl.constexpr = BKW // WPG
    dt = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, BG, WPG], tl.float32)   # summed across lanes once, after the loop
    pdl_wait(PDL)
    for g0 in tl.range(0, KG, BG, num_stages=STAGES):
        g = g0 + tl.arange(0, BG)
        words, high, scale = load_step(p_ptr, s_ptr, n, g, N, KW, KG, WPG)
        xw = (g[:, None] * WPG + tl.arange(0, WPG)[None, :]) * 8   # [BG, WPG]: each word's first input
        x_ok = g[:, None] < KG
        part = tl.zeros([BN, BG, WPG], tl.float32)   # each word's eight products, unscaled
        for i in tl.static_range(8):
            xi = tl.load(x_ptr + xw + i, mask=x_ok, other=0.0).to(tl.float32)
            part += plane(words, high, i, nib) * xi[None, :, :]
        acc += part * scale.to(tl.float32)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_B:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(dt), mask=n < N)


def _gemm_kernel(x_ptr, p_ptr, s_ptr, b_ptr, y_ptr, M, N, nib, K: tl.constexpr, G: tl.constexpr,
                 HAS_B: tl.constexpr, SCALE_DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BKW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    KW: tl.constexpr = K // 8
    KG: tl.constexpr = K // G
    WPG: tl.constexpr = G // 8
    BG: tl.constexpr = BKW // WPG
    dt = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    acc = tl.zeros([BN, BM], tl.float32)   # y transposed: the weight rows are the MMA's M
    pdl_wait(PDL)
    for g0 in tl.range(0, KG, BG, num_stages=STAGES):
        words, high, scale = load_step(p_ptr, s_ptr, n, g0 + tl.arange(0, BG), N, KW, KG, WPG)
        j = g0 * WPG + tl.arange(0, BKW)
        x_at = x_ptr + m[None, :] * K + j[:, None] * 8
        x_ok = (j[:, None] < KW) & (m[None, :] < M)
        for i in tl.static_range(8):
            xi = tl.load(x_at + i, mask=x_ok, other=0.0)   # [BKW, BM]: input 8j + i of each row
            w = scaled(plane(words, high, i, nib), scale, dt, SCALE_DT, BN, BKW)
            acc = tl.dot(w, xi, acc, input_precision="ieee")
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + m[None, :] * N + n[:, None], acc.to(dt), mask=(n[:, None] < N) & (m[None, :] < M))


def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
           bias: torch.Tensor | None = None, blocks: Blocks | GemvBlocks | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias for the int4 weight W [N, K] (packed [N, K / 8], scale [N, K / G]):
    [..., N] in x's dtype. One row takes the GEMV where GEMV_ONE_ROW, more the tiles; `blocks`
    (GemvBlocks for the GEMV at one row, Blocks for the tiles at any) overrides the tables."""
    N, K = packed.shape[0], x.shape[-1]
    check_group(group_size, K)
    int4_ops.check_layout(packed, scale, group_size, K)
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"int4 linear: bias {tuple(bias.shape)} for {N} outputs")
    lead = x.shape[:-1]
    x = x.reshape(-1, K).contiguous()
    M = x.shape[0]
    packed, scale = packed.contiguous(), scale.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*lead, N)
    b = bias.contiguous() if bias is not None else y
    pdl = pdl_options(x.device)
    gemv = isinstance(blocks, GemvBlocks) or (blocks is None and GEMV_ONE_ROW)
    if M == 1 and gemv:
        g = blocks if isinstance(blocks, GemvBlocks) else GEMV
        jit_kernel(_gemv_kernel, interpreting(), ("N", "nib"))[(cdiv(N, g.bn),)](
            x, packed, scale, b, y, N, NIBBLE, K=K, G=group_size, HAS_B=bias is not None, BN=g.bn,
            BKW=step_words(g.bkw, group_size), STAGES=g.stages, num_warps=g.warps, **pdl)
    else:
        t = blocks if isinstance(blocks, Blocks) else blocks_for(M)
        jit_kernel(_gemm_kernel, interpreting(), ("M", "N", "nib"))[(cdiv(N, t.bn), cdiv(M, t.bm))](
            x, packed, scale, b, y, M, N, NIBBLE, K=K, G=group_size, HAS_B=bias is not None,
            SCALE_DT=scale.dtype == x.dtype, BM=t.bm, BN=t.bn, BKW=step_words(t.bkw, group_size),
            STAGES=t.stages, num_warps=t.warps, **pdl)
    return y.view(*lead, N)
