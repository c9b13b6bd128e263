"""The (token, k) pairs of a MoE forward laid out by expert for the grouped GEMMs (`moe_kernel`).

Layout, for P = N·k pairs over E experts and tiles of BM rows: expert e's pairs fill
ceil(count_e / BM) consecutive tiles, experts in order, pairs within an expert in ascending pair
index (p = n·k + j); the rest of an expert's last tile is padding. `pairs` [T·BM] holds each slot's
pair, P for padding; `tile_expert` [T] each tile's expert, E for tiles past the last real one.
T = (P + min(E, P)·(BM − 1)) // BM bounds the tiles whatever the routing: each of the at most
min(E, P) experts hit pads its last tile by at most BM − 1 rows. A pair of id E (an expert on
another tensor-parallel rank, `models.moe.Experts.local`) takes no slot: no tile computes it. So every size depends on N, k,
E and BM only, and neither form reads anything back to the host: both can be captured in a CUDA
graph.

Two forms build the same layout: one Triton program (`align`, few pairs: a decode, draft or
verify, whose expert GEMMs take about as long as a dozen launches of the torch form would) and
torch ops around a stable sort (`align_torch`, many pairs: the one program's work grows as
pairs × experts).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from drafttree.kernels.triton_jit import interpreting, jit_kernel, next_pow2, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

# Pairs up to which the one-program form builds the layout (128 rows at top-8).
ALIGN_KERNEL_MAX_PAIRS = 1024
# Elements of the program's [pairs or tiles, experts] comparison blocks (a power of two).
ALIGN_BLOCK = 8192


class Layout(NamedTuple):
    pairs: torch.Tensor        # [T * BM] int32: the pair in each slot, P for padding
    tile_expert: torch.Tensor  # [T] int32: each tile's expert, E past the last real tile
    block_m: int


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """The most tiles P pairs over E experts can fill (each hit expert pads at most BM − 1 slots)."""
    return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m


def _align_kernel(ids_ptr, pairs_ptr, tiles_ptr, P, T, E: tl.constexpr, EB: tl.constexpr, BP: tl.constexpr,
                  BT: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    e = tl.arange(0, EB)
    counts = tl.zeros([EB], tl.int32)
    # while loops: Triton's interpreter cannot take a run-time bound in range()
    p0 = 0
    while p0 < P:
        p = p0 + tl.arange(0, BP)
        ids = tl.load(ids_ptr + p, mask=p < P, other=EB).to(tl.int32)
        ids = tl.where(ids < E, ids, EB)   # EB matches no expert: padding lanes, other ranks' pairs
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
        p0 += BP
    tiles = (counts + BM - 1) // BM
    end = tl.cumsum(tiles, axis=0)
    start = end - tiles
    # Tiles: the owning expert and the padding. Padding slots and the pairs' slots (below) are
    # disjoint, so the two passes need no barrier between them.
    r = tl.arange(0, BM)
    t0 = 0
    while t0 < T:
        t = t0 + tl.arange(0, BT)
        own = (start[None, :] <= t[:, None]) & (t[:, None] < end[None, :])   # [BT, EB]: one expert or none
        expert = tl.sum(tl.where(own, e[None, :], 0), axis=1) + E * (1 - tl.sum(own.to(tl.int32), axis=1))
        rows = tl.sum(tl.where(own, counts[None, :] - (t[:, None] - start[None, :]) * BM, 0), axis=1)
        tl.store(tiles_ptr + t, expert, mask=t < T)
        pad = (r[None, :] >= rows[:, None]) & (t[:, None] < T)
        tl.store(pairs_ptr + t[:, None] * BM + r[None, :], tl.zeros([BT, BM], tl.int32) + P, mask=pad)
        t0 += BT
    # Pairs: each to its expert's next free slot, in pair order.
    nxt = start * BM
    p0 = 0
    while p0 < P:
        p = p0 + tl.arange(0, BP)
        ids = tl.load(ids_ptr + p, mask=p < P, other=EB).to(tl.int32)
        ids = tl.where(ids < E, ids, EB)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)                   # [BP, EB]
        before = tl.cumsum(hit, axis=0) - hit                             # same-expert pairs earlier in the block
        slot = tl.sum(hit * (nxt[None, :] + before), axis=1)
        tl.store(pairs_ptr + slot, p, mask=(p < P) & (ids < E))
        nxt += tl.sum(hit, axis=0)
        p0 += BP


def align(idx: torch.Tensor, num_experts: int, block_m: int) -> Layout:
    """The layout of idx [N, k] (expert ids in [0, E], E: no slot) in one Triton launch (where
    kernels run)."""
    P = idx.numel()
    T = max_tiles(P, num_experts, block_m)
    pairs = torch.empty(T * block_m, dtype=torch.int32, device=idx.device)
    tile_expert = torch.empty(T, dtype=torch.int32, device=idx.device)
    eb = next_pow2(num_experts)
    bp = max(16, ALIGN_BLOCK // eb)
    bt = max(16, ALIGN_BLOCK // max(eb, block_m))
    jit_kernel(_align_kernel, interpreting(), ("P", "T"))[(1,)](
        idx.reshape(-1).contiguous(), pairs, tile_expert, P, T, E=num_experts, EB=eb, BP=bp, BT=bt, BM=block_m,
        num_warps=8, **pdl_options(idx.device))
    return Layout(pairs, tile_expert, block_m)


def align_torch(idx: torch.Tensor, num_experts: int, block_m: int) -> Layout:
    """The same layout by torch ops: a stable sort, then counts and offsets by binary search (no
    atomics, no read-back)."""
    flat = idx.reshape(-1)
    P, dev = flat.numel(), flat.device
    T = max_tiles(P, num_experts, block_m)
    ids, order = flat.sort(stable=True)
    experts = torch.arange(num_experts, device=dev, dtype=ids.dtype)
    first = torch.searchsorted(ids, experts)                    # each expert's first sorted position
    counts = torch.searchsorted(ids, experts, right=True) - first
    tiles = (counts + block_m - 1) // block_m
    end = tiles.cumsum(0)
    start = end - tiles
    # the first expert whose tiles end after t: E past the last real tile
    tile_expert = torch.searchsorted(end, torch.arange(T, device=dev, dtype=end.dtype), right=True)
    mine = ids < num_experts               # id E sorts last and takes no slot (one spare, cut below)
    at = ids.clamp(max=num_experts - 1)
    slot = torch.where(mine, start[at] * block_m + torch.arange(P, device=dev) - first[at], T * block_m)
    pairs = torch.full((T * block_m + 1,), P, dtype=torch.int32, device=dev)
    pairs.scatter_(0, slot, order.to(torch.int32))
    return Layout(pairs[:T * block_m], tile_expert.to(torch.int32), block_m)


def layout(idx: torch.Tensor, num_experts: int, block_m: int) -> Layout:
    """`align` for up to ALIGN_KERNEL_MAX_PAIRS pairs, else `align_torch`."""
    if idx.numel() <= ALIGN_KERNEL_MAX_PAIRS:
        return align(idx, num_experts, block_m)
    return align_torch(idx, num_experts, block_m)
