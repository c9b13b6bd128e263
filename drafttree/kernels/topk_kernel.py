"""The vocabulary top-K and the log-softmax normalizer of the draft logits, in two Triton launches.

`top_log_probs` in torch ops costs a float copy, a pad, two top-K passes and a separate
exp-sum pass over [R, L, V]. Here the logits are read once:

1. one program per (row, chunk of CHUNK tokens): the chunk's max, its sum of exp(x - max), and
   its top K2 entries (K2 = K rounded up to a power of two, at least 2): a threshold from the
   float maxima of 4 K2 strided groups leaves a few K2 candidates, and only those are keyed and
   sorted (FILTERED); a chunk with too many (ties) takes its top K2 slice by slice (SLICE);
2. one program per row: the logsumexp from the chunk partials, and the top K of the chunks'
   candidates.

Entries are compared as int64 keys: the order-preserving int32 of the float32 value in the high
half, INT32_MAX - token id in the low half. So values tie-break towards the smaller token id,
like a stable sort, and ids come back without a separate gather. The top values are the logits
themselves; the normalizer sums in another order than torch, so log-probs agree to rounding.

Triton is imported on first use; with TRITON_INTERPRET=1 set before that, it runs on CPU.
"""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels.triton_jit import device_function, jit_kernel, next_pow2

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()
INT32_MAX = 2**31 - 1
# Chunk top-K by a threshold from group maxima, then a sort of the few entries above it (see
# _chunk_kernel); False takes every chunk's top-K slice by slice.
FILTERED = True
# benchmarks/topk_chunk_bench.py (H200, vocabulary 151,936, bf16): with the filter 8,192 is the
# best chunk at k = 8 / 32 / 128 (35 / 43 / 87 us per 15 positions), against 4,096 without it
# (then one sort of the whole chunk; unfiltered chunks now go slice by slice, not timed on a GPU).
# Today's filter (strided float groups, a counted threshold, keys for the candidates only) takes
# k = 32 / 128 to 28.0 / 68.0 us.
CHUNK = 8192
CHUNK_WARPS = 4   # top-K at k = 32: 28.0 us, against 31.0 at 8 warps (H200)
# The whole-chunk top-K runs over SLICE entries at a time, merged into a running top K2: one
# sorting network over CHUNK entries made the kernel's compile 7.5 / 10.7 s at K2 = 8 / 32 against
# 3.3 / 3.5 s with slices of 256 (benchmarks/triton_compile_bench.py, sm_90, Triton 3.9; 4.9 / 6.8
# against 1.8 / 1.8 s with 3.6), paid by every cold start for a path real logits seldom take.
SLICE = 256
MERGE_WARPS = 4   # top-K at k = 32 (an earlier chunk kernel): 42.7 us, against 44.2 at 2 warps, 49.2 at 1


@device_function
def high_key(x):
    """The high half of an int64 key for fp32 x: x's order-preserving int32 (-0.0 as 0.0) << 32,
    so one integer compare orders keys by x, then by their low halves."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32


@device_function
def sort_key(x, tok):
    """The key of value x at token id tok: the larger value, then the smaller id, is larger."""
    return high_key(x) | (2147483647 - tok).to(tl.int64)


def _chunk_kernel(x_ptr, key_ptr, m_ptr, s_ptr, scr_ptr, V, NC, CHUNK: tl.constexpr, K2: tl.constexpr,
                  FILTER: tl.constexpr, GROUPS: tl.constexpr, CAP: tl.constexpr, RANK: tl.constexpr,
                  SLICE: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    tok = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * V + tok, mask=tok < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m)), axis=0)
    out = row * NC + c
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    # Keys (`sort_key`), and below every real key past the vocabulary (and in empty slots).
    best = tl.full([K2], -(2**63), tl.int64)   # defined on every path, as Triton's if needs
    over = True
    if FILTER:
        # The K2 largest group maxima are K2 distinct entries, so the chunk's top K2 all have a
        # value at least the smallest of them: select among those (K2 to a few K2 on real
        # logits) instead of sorting all CHUNK; a chunk with more than CAP of them (ties) sorts
        # all. Group j holds entries j, j + GROUPS, ...: a last chunk's real prefix spans all
        # groups (or each real entry is a group of its own), and real logits cluster by token
        # id, where runs of consecutive entries as groups overflowed CAP (see filter_plan).
        gmax = tl.max(tl.reshape(x, [CHUNK // GROUPS, GROUPS]), 0)
        if RANK:   # the K2-th largest maximum is the smallest with fewer than K2 larger: no sort
            above = tl.sum((gmax[None, :] > gmax[:, None]).to(tl.int32), 1)
            threshold = tl.min(tl.where(above < K2, gmax, float("inf")), 0)
        else:
            threshold = tl.min(tl.topk(gmax, K2), 0)
        cand = (x >= threshold) & (tok < V)
        n = tl.sum(cand.to(tl.int32), 0)
        over = n > CAP
        if not over:   # the candidates' offsets to slots 0..n-1; their values read back (L1)
            slot = tl.arange(0, CAP)
            buf = scr_ptr + out.to(tl.int64) * CAP
            tl.store(buf + tl.cumsum(cand.to(tl.int32), 0) - 1, tl.arange(0, CHUNK), mask=cand)
            tl.debug_barrier()
            ctok = c * CHUNK + tl.load(buf + slot, mask=slot < n, other=0)
            cx = tl.load(x_ptr + row.to(tl.int64) * V + ctok).to(tl.float32)
            best = tl.topk(tl.where(slot < n, sort_key(cx, ctok), -(2**63)), K2)
    if over:   # the top K2 of each slice merged into the running top K2 (keys are distinct)
        best = tl.full([K2], -(2**63), tl.int64)
        for s0 in range(0, CHUNK, SLICE):
            t = c * CHUNK + s0 + tl.arange(0, SLICE)
            xs = tl.load(x_ptr + row.to(tl.int64) * V + t, mask=t < V, other=float("-inf")).to(tl.float32)
            top = tl.topk(tl.where(t < V, sort_key(xs, t), -(2**63)), K2)
            best = tl.topk(tl.reshape(tl.join(best, top), [2 * K2]), K2)
    tl.store(key_ptr + out * K2 + tl.arange(0, K2), best)


def _merge_kernel(key_ptr, m_ptr, s_ptr, lp_ptr, idx_ptr, NC, K, NC_PAD: tl.constexpr,
                  K2: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, NC_PAD)
    m = tl.load(m_ptr + row * NC + c, mask=c < NC, other=float("-inf"))
    s = tl.load(s_ptr + row * NC + c, mask=c < NC, other=0.0)
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0))
    j = tl.arange(0, NC_PAD * K2)
    keys = tl.load(key_ptr + row * NC * K2 + j, mask=j < NC * K2, other=-(2**63))
    best = tl.topk(keys, K2)
    ordered = (best >> 32).to(tl.int32)
    value = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    tok = 2147483647 - (best & 0xFFFFFFFF)
    k = tl.arange(0, K2)
    tl.store(lp_ptr + row * K + k, value - lse, mask=k < K)
    tl.store(idx_ptr + row * K + k, tok, mask=k < K)


def filter_plan(k2: int, chunk: int) -> tuple[int, int, bool]:
    """(groups, cap, rank) of the chunk filter. With 4 K2 groups, on Gaussian logits a 4,096 chunk
    has on average 8 / 37 / 145 entries at or above the threshold for K2 = 8 / 32 / 128 (at most
    10 / 43 / 158 over 200 chunks): CAP = 2 K2 (at least 64) holds them. On the default model's
    logits (2,197 positions, `filter_counts`) strided groups kept at most 15 / 55 at K2 = 8 / 32;
    groups of consecutive entries kept up to 71 / 123 (3.1% of chunks over CAP at K2 = 32). Up
    to 128 groups the threshold is found by a [groups, groups] count (rank), beyond by a top-K2
    of the maxima."""
    groups = min(chunk, max(128, 4 * k2))
    return groups, max(64, 2 * k2), groups <= 128


def filter_counts(x: torch.Tensor, k2: int, chunk: int = CHUNK) -> torch.Tensor:
    """How many entries of each chunk of logits x [..., V] the filter of `_chunk_kernel` keeps as
    candidates, [..., chunks] (over CAP, that chunk sorts all): its groups in torch."""
    V = x.shape[-1]
    groups = filter_plan(k2, chunk)[0]
    nc = -(-V // chunk)
    pad = x.new_full((*x.shape[:-1], nc * chunk - V), float("-inf"), dtype=torch.float32)
    chunks = torch.cat([x.float(), pad], -1).unflatten(-1, (nc, chunk))
    gmax = chunks.unflatten(-1, (chunk // groups, groups)).amax(-2)   # group j: j, j + groups, ...
    threshold = gmax.topk(min(k2, groups), dim=-1).values[..., -1:]
    real = (torch.arange(nc * chunk, device=x.device) < V).view(nc, chunk)
    return ((chunks >= threshold) & real).sum(-1)


def top_log_probs_fused(logits: torch.Tensor, k: int, interpret: bool = False,
                        chunk: int = CHUNK, warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_ops.top_log_probs` in two launches: [R, L, k] log-probs (float32, descending) and token
    ids (int64) of the k best tokens of each position of logits [R, L, V] (any float dtype)."""
    R, L, V = logits.shape
    if k > V or V >= INT32_MAX:
        raise ValueError(f"top-{k} of a vocabulary of {V}")
    x = logits.contiguous()
    # K2 >= 2: Triton's top-k of one element reduces its hypercube to a scalar and fails to compile
    rows, k2 = R * L, max(2, next_pow2(k))
    nc = -(-V // chunk)
    dev = logits.device
    keys = torch.empty(rows, nc, k2, dtype=torch.int64, device=dev)
    m = torch.empty(rows, nc, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    lp = torch.empty(R, L, k, dtype=torch.float32, device=dev)
    idx = torch.empty(R, L, k, dtype=torch.int64, device=dev)
    chunk_kernel, merge_kernel = jit_kernel(_chunk_kernel, interpret), jit_kernel(_merge_kernel, interpret)
    groups, cap, rank = filter_plan(k2, chunk)
    scratch = torch.empty(rows * nc * cap if FILTERED else 1, dtype=torch.int32, device=dev)
    chunk_kernel[(rows, nc)](x, keys, m, s, scratch, V, nc, CHUNK=chunk, K2=k2, FILTER=FILTERED,
                             GROUPS=groups, CAP=cap, RANK=rank, SLICE=min(chunk, max(SLICE, k2)),
                             num_warps=warps or CHUNK_WARPS)
    merge_kernel[(rows,)](keys, m, s, lp, idx, nc, k, NC_PAD=next_pow2(nc), K2=k2, num_warps=MERGE_WARPS)
    return lp, idx
