"""`spec_decode.tree.build_tree` fused into one Triton kernel launch.

The vocabulary top-K and the log-softmax normalizer come from `dispatch.top_log_probs`
(on CUDA, the kernels of `topk_kernel.py`), shared verbatim with `build_tree`; `build`
takes them. Everything after them runs in one program per request: the L level selections
(a bitonic top-B over the candidate pairs), the final best-first order (a running
bitonic merge of each level into the best B so far), parents, depths and the
ancestor mask.

Order and ties. Every comparison is on a 64-bit key: the float32 score in the
high half, mapped to an order-preserving integer, and an index in the low
half. A level keeps the top B candidates by (score desc, candidate index asc)
and the final order is (score desc, depth asc, slot asc), exactly the
`torch.sort(..., stable=True)` of `build_tree`. The one place `build_tree`
itself is not canonical is its per-level `topk`, whose order among exactly
equal candidate scores is whatever the backend's topk returns; wherever
those do not tie, the two functions agree bit for bit.

Triton is optional and imported on first use. With TRITON_INTERPRET=1 set
before triton is first imported, the kernel runs (slowly) on CPU tensors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from drafttree.kernels.topk_kernel import high_key
from drafttree.kernels.triton_jit import interpreting, jit_kernel, kernels_run_on, next_pow2

tl: Any = None  # triton.language, bound by jit_kernel()
_PAIRS: dict[tuple[int, int, torch.device], torch.Tensor] = {}

# Largest budget for which `available(device, budget)` prefers the kernel: on an H200 at
# V = 151,936 and L = 15 it beat build_tree at budgets 32 and 128 but not at 512.
MAX_FUSED_BUDGET = 128


class TreeTensors(NamedTuple):
    """The fields of a `spec_decode.tree.DraftTree`, as `build_tree` makes them."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    visible: torch.Tensor


def available(device: torch.device | str, budget: int | None = None) -> bool:
    """Whether the kernel runs on `device`: CUDA with triton installed, or CPU/CUDA under
    TRITON_INTERPRET=1 (slow; for tests).

    With `budget`, also whether the kernel is the faster choice (budget <= MAX_FUSED_BUDGET).
    """
    if budget is not None and budget > MAX_FUSED_BUDGET:
        return False
    return kernels_run_on(device)


def _tree_kernel(lp_ptr, idx_ptr, pair_ptr, root_ptr, tok_ptr, par_ptr, dep_ptr, valid_ptr,
                 vis_ptr, scratch_ptr, R, L: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                 N: tl.constexpr, B: tl.constexpr, B_PAD: tl.constexpr, LOG_B: tl.constexpr,
                 M_PAD: tl.constexpr, LOG_M: tl.constexpr, N_PAD: tl.constexpr,
                 BI: tl.constexpr, BJ: tl.constexpr):
    pid = tl.program_id(0)
    neg_inf = float("-inf")
    low_top = 1 << 30  # low half of a tree key: low_top - (depth - 1) * B - slot
    LB = L * B
    tok_scr = scratch_ptr + pid * LB
    par_scr = scratch_ptr + (R + pid) * LB
    col_scr = scratch_ptr + (2 * R + pid) * LB
    base = pid * L * K

    # Scores are packed into int64 keys, `high_key(score) | low`: one integer compare orders by
    # score, then by low (distinct per entry).
    # level 0: the top-K tokens of position 0; slots K..B-1 hold no prefix
    pos = tl.arange(0, B_PAD)
    in_b = pos < B
    score = tl.load(lp_ptr + base + pos, mask=pos < K, other=neg_inf)
    tl.store(tok_scr + pos, tl.load(idx_ptr + base + pos, mask=pos < K, other=0).to(tl.int32),
             mask=in_b)
    tl.store(par_scr + pos, tl.zeros([B_PAD], tl.int32), mask=in_b)
    pad_key = -2139095041 * (1 << 32)  # key of -inf with low half 0, below every real key
    run = tl.where(in_b, high_key(score) | (low_top - pos), pad_key)
    # A level's scores are kept ascending: position i holds slot B_PAD - 1 - i.
    slot = B_PAD - 1 - pos
    score = tl.load(lp_ptr + base + slot, mask=slot < K, other=neg_inf)

    p = tl.arange(0, M_PAD)
    p_ok = p < M
    pair = tl.load(pair_ptr + p, mask=p_ok, other=0)
    p_slot = pair >> 16
    p_rank = pair & 0xFFFF
    off = base + K + p_rank
    lp_next = tl.load(lp_ptr + off, mask=p_ok & (L > 1), other=neg_inf)
    tok_next = tl.load(idx_ptr + off, mask=p_ok & (L > 1), other=0).to(tl.int32)
    for d in range(1, L):
        lp = lp_next
        cand_tok = tok_next
        off = base + (d + 1) * K + p_rank  # prefetch the next level's candidates
        lp_next = tl.load(lp_ptr + off, mask=p_ok & (d + 1 < L), other=neg_inf)
        tok_next = tl.load(idx_ptr + off, mask=p_ok & (d + 1 < L), other=0).to(tl.int32)
        cand = tl.gather(score, B_PAD - 1 - p_slot, 0) + lp
        # padding pairs get distinct low halves too (every key distinct)
        ckey = tl.where(p_ok, high_key(cand), pad_key) | (M_PAD - p)

        # Bitonic top-k on the hypercube [2] * LOG_M: sort runs of B_PAD keys in alternating
        # directions, then halve (pairwise max of an ascending and a descending run is a
        # bitonic sequence holding the top B_PAD of both) and re-merge, last merge ascending.
        # A compare-exchange along an axis of size 2 puts each pair's max where take_max.
        h = tl.reshape(ckey, [2] * LOG_M)
        for stage in tl.static_range(1, LOG_B + 1):
            if stage < LOG_M:
                flip = tl.reshape(tl.arange(0, 2), [1] * (LOG_M - 1 - stage) + [2] + [1] * stage)
            else:
                flip = tl.zeros([1] * LOG_M, tl.int32)
            for i in tl.static_range(stage):
                right = tl.reshape(tl.arange(0, 2),
                                   [1] * (LOG_M - stage + i) + [2] + [1] * (stage - 1 - i))
                take_max = (right ^ flip) == 1
                h = tl.where(take_max, tl.max(h, LOG_M - stage + i, keep_dims=True),
                             tl.min(h, LOG_M - stage + i, keep_dims=True))
        for r in tl.static_range(LOG_M - LOG_B):
            h = tl.max(h, LOG_M - 1 - r - LOG_B)
            if LOG_B < LOG_M - 1 - r:
                flip = tl.reshape(tl.arange(0, 2), [1] * (LOG_M - 2 - r - LOG_B) + [2] + [1] * LOG_B)
            else:
                flip = tl.zeros([1] * LOG_B, tl.int32)
            for i in tl.static_range(LOG_B):
                right = tl.reshape(tl.arange(0, 2),
                                   [1] * (LOG_M - 1 - r - LOG_B + i) + [2] + [1] * (LOG_B - 1 - i))
                take_max = (right ^ flip) == 1
                h = tl.where(take_max, tl.max(h, LOG_M - 1 - r - LOG_B + i, keep_dims=True),
                             tl.min(h, LOG_M - 1 - r - LOG_B + i, keep_dims=True))
        top = tl.reshape(h, [B_PAD])

        hi = (top >> 32).to(tl.int32)
        score = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        score = tl.where(slot < B, score, neg_inf)
        pick = tl.minimum(M_PAD - (top & 0xFFFFFFFF).to(tl.int32), M_PAD - 1)
        tl.store(tok_scr + d * B + slot, tl.gather(cand_tok, pick, 0), mask=slot < B)
        tl.store(par_scr + d * B + slot, tl.gather(p_slot, pick, 0), mask=slot < B)

        # merge the level (ascending) into the running best B (descending): their
        # pairwise max is bitonic and holds the top B of the union
        s = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
        lkey = tl.where(slot < B, ((s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32)
                        | (low_top - d * B - slot), pad_key)
        h = tl.reshape(tl.maximum(run, lkey), [2] * LOG_B)
        for i in tl.static_range(LOG_B):
            right = tl.reshape(tl.arange(0, 2), [1] * i + [2] + [1] * (LOG_B - 1 - i))
            h = tl.where(right == 0, tl.max(h, i, keep_dims=True), tl.min(h, i, keep_dims=True))
        run = tl.reshape(h, [B_PAD])

    # the final B nodes, best first; columns 1..B
    hi = (run >> 32).to(tl.int32)
    node_score = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    flat = low_top - (run & 0xFFFFFFFF).to(tl.int32)
    valid = in_b & (node_score > neg_inf)
    level = flat // B
    col = pos + 1
    tl.debug_barrier()
    node_tok = tl.load(tok_scr + flat, mask=valid, other=0)
    parent_slot = tl.load(par_scr + flat, mask=valid, other=0)
    tl.store(col_scr + flat, col, mask=valid)
    tl.debug_barrier()
    parent_col = tl.load(col_scr + (level - 1) * B + parent_slot, mask=valid & (level > 0), other=0)

    row = pid * N
    tl.store(tok_ptr + row, tl.load(root_ptr + pid).to(tl.int64))
    tl.store(par_ptr + row, 0)
    tl.store(dep_ptr + row, 0)
    tl.store(valid_ptr + row, 1)
    tl.store(tok_ptr + row + col, tl.where(valid, node_tok, 0).to(tl.int64), mask=in_b)
    tl.store(par_ptr + row + col, parent_col.to(tl.int64), mask=in_b)
    tl.store(dep_ptr + row + col, tl.where(valid, level + 1, 1).to(tl.int64), mask=in_b)
    tl.store(valid_ptr + row + col, valid.to(tl.uint8), mask=in_b)

    # parent by column (0 is the root)
    c = tl.arange(0, N_PAD)
    src = tl.minimum(tl.maximum(c - 1, 0), B_PAD - 1)
    par_c = tl.where((c >= 1) & (c < N), tl.gather(parent_col, src, 0), 0)

    # visible[i, j]: j is met walking up from i; L hops reach the root from any depth
    for i0 in range(0, N, BI):
        rows = i0 + tl.arange(0, BI)
        for j0 in range(0, N, BJ):
            cols = j0 + tl.arange(0, BJ)
            cur = tl.where(rows < N, rows, 0)
            hit = cur[:, None] == cols[None, :]
            for step in range(L):
                cur = tl.gather(par_c, cur, 0)
                hit = hit | (cur[:, None] == cols[None, :])
            tl.store(vis_ptr + pid * N * N + rows[:, None] * N + cols[None, :], hit.to(tl.uint8),
                     mask=(rows[:, None] < N) & (cols[None, :] < N))


def _pairs(budget: int, k: int, device: torch.device) -> torch.Tensor:
    """The candidate (slot, rank) pairs of `build_tree` (its `_pair_index`), in its order, as
    slot << 16 | rank: slot i pairs with ranks below min(k, budget // (i + 1)), as any other pair
    is outscored by at least `budget` candidates. Static-shape tensor ops, as capture needs."""
    key = (budget, k, device)
    if key in _PAIRS:
        return _PAIRS[key]
    m = sum(min(k, budget // s) for s in range(1, budget + 1))
    slots = torch.arange(budget, device=device)
    count = torch.clamp(budget // (slots + 1), max=k)
    slot = torch.repeat_interleave(slots, count, output_size=m)
    rank = torch.arange(m, device=device) - (count.cumsum(0) - count)[slot]
    pairs = ((slot << 16) | rank).int()
    # a tensor made during graph capture is filled only at replay: do not keep it
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _PAIRS[key] = pairs
    return pairs


def build(top_lp: torch.Tensor, top_idx: torch.Tensor, root_tokens: torch.Tensor, budget: int) -> TreeTensors:
    """`build_tree`'s tree of `budget` nodes per request from the top-K log-probs and token ids
    [R, L, K] of its draft logits (K = min(budget, V), descending) and the roots [R]. Where the
    kernel runs (`available`), at budgets below 2^16 and L * budget below 2^29."""
    R, L, K = top_lp.shape
    device = top_lp.device
    B = budget
    if K > B or not (1 <= B < 1 << 16 and L * B < 1 << 29):
        raise ValueError(f"fused tree: budget {B}, top-{K} of {L} positions")
    top_lp = top_lp.contiguous()

    pairs = _pairs(B, K, device) if L > 1 else torch.zeros(1, dtype=torch.int32, device=device)
    M = pairs.numel()
    b_pad = max(2, next_pow2(B))
    m_pad = max(b_pad, next_pow2(M))
    N = B + 1
    tokens = torch.empty(R, N, dtype=torch.long, device=device)
    parents = torch.empty_like(tokens)
    depth = torch.empty_like(tokens)
    valid = torch.empty(R, N, dtype=torch.uint8, device=device)
    visible = torch.empty(R, N, N, dtype=torch.uint8, device=device)
    scratch = torch.empty(3, R, L * B, dtype=torch.int32, device=device)
    bi = min(64, next_pow2(N))
    bj = min(256, next_pow2(N))
    jit_kernel(_tree_kernel, interpreting())[(R,)](
        top_lp, top_idx.contiguous(), pairs, root_tokens.contiguous(), tokens, parents, depth,
        valid, visible, scratch, R, L=L, K=K, M=M, N=N, B=B, B_PAD=b_pad,
        LOG_B=b_pad.bit_length() - 1, M_PAD=m_pad, LOG_M=m_pad.bit_length() - 1,
        N_PAD=next_pow2(N), BI=bi, BJ=bj,
        # budget 32 on an H200: 63 us for the whole build at 4 warps, 74 at 2, 109 at 1
        num_warps=4 if m_pad <= 256 else 8,
    )
    return TreeTensors(tokens, parents, depth, valid.view(torch.bool), visible.view(torch.bool))
