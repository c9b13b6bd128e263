"""Top-k / top-p thresholds without a sort: a radix descent over the logits' order-preserving keys.

`sampling.filter_thresholds` defines what is kept; this is its Triton form. Each logit is keyed
by the order-preserving int32 of its float32 value, and the threshold key is found 8 bits at a
time, from the top byte down. A level histograms, over the 256 values of its byte, the entries
whose higher bytes match the prefix chosen so far: counts for top-k, masses for top-p. The bin
that holds the target (the k-th entry from the top; the first entry at which the mass from the
top reaches p of the kept set's) extends the prefix; after 4 levels the prefix is the threshold's
key.

Launches (9, fixed shapes, no host sync): step 0 takes each chunk's max and the top-k level-0
counts; steps 1-3 the top-k levels; step 4 its result (the top-k key) and the top-p level-0
masses of the entries at or above it; steps 5-7 the top-p levels; step 8 writes the threshold.
Each of steps 0-7 runs a program per (row, chunk of CH entries); every program first reduces
the previous step's per-chunk partials for its row (integers: any order gives the same sums)
and chooses the bin, and program 0 of each row keeps that choice for the next step. Rows
without top-k (top-p) return at once from its steps; a chunk with no entry in the chosen bin
writes zero partials without reading the logits.

A top-p mass is exp((x - max) / T) in fixed point, 2**-FRAC_BITS units, summed as int64: the
levels then agree exactly (a bin's sub-bins add up to it), and sums do not depend on order, so
the same logits always give the same threshold. Below 2**-FRAC_BITS of the max a mass is 0:
such an entry is never at the threshold. Nor is one below a bound from p and V (`low` in the
kernel): those count in the kept set's mass Z only, so that on a peaked row (a language model's)
most blocks of top-p levels skip their histogram. A histogram is an int8 matrix product: row (digit d,
high bits h) of one operand holds 7-bit digit d of an entry's mass where h is its byte's high
bits, the other the one-hot of its low bits (counts: one digit, of value 1).

Triton is imported on first use; with TRITON_INTERPRET=1 set before that, it runs on CPU.
"""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels.topk_kernel import high_key
from drafttree.kernels.triton_jit import cdiv, device_function, jit_kernel, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

BLOCKS = (256, 128)  # entries per histogram product: counts, masses
# Entries per program (benchmarks/filter_bench.py, H200, µs per call at chunks of 1,024 to
# 16,384): one row of 49,152 fastest at 2,048 (86 against 102-124 beside it), one of 151,936 at
# 4,096 (187-193 against 235-330), 33 rows of 151,936 and 128 or 512 rows of 49,152 at 8,192 (or
# 16,384, within 2 %). So a program takes V * rows / SPREAD entries, a power of two from MIN_CHUNK
# to MAX_CHUNK.
MIN_CHUNK, MAX_CHUNK, SPREAD = 2048, 8192, 24
FRAC_BITS = 44     # V * 2**44 < 2**63 for V < 2**19
MAX_VOCAB = 1 << 19


@device_function
def ordered_key(x):
    """fp32 x as an int32 in the same order (-0.0 as 0.0): the high half of the top-K's key."""
    return (high_key(x) >> 32).to(tl.int32)


@device_function
def key_value(s):
    """The fp32 value of an `ordered_key`."""
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@device_function
def chunk_totals(part_ptr, g, NC):
    """A row's 256 bin totals over its chunks' partials, from the top bin down."""
    j = tl.arange(0, 256)[None, :]
    cs = tl.arange(0, 8)[:, None]
    total = tl.zeros([256], tl.int64)
    c = 0
    while c < NC:   # (runtime bounds: `while`, as the interpreter takes no `range` of them)
        rows = part_ptr + (g.to(tl.int64) * NC + c + cs) * 256
        total += tl.sum(tl.load(rows + 255 - j, mask=c + cs < NC, other=0), 0)
        c += 8
    return total


@device_function
def chunk_sum(z_ptr, g, NC):
    """The sum of a row's per-chunk int64 partials z [rows, NC]."""
    cc = tl.arange(0, 64)
    z = tl.full([], 0, tl.int64)
    c0 = 0
    while c0 < NC:
        z += tl.sum(tl.load(z_ptr + g.to(tl.int64) * NC + c0 + cc, mask=c0 + cc < NC, other=0), 0)
        c0 += 64
    return z


@device_function
def choose_bin(total, t):
    """The bin (0-255) holding the t-th unit from the top of `total` (from `chunk_totals`), and t
    less the units of the bins above it."""
    j = tl.arange(0, 256)
    above = tl.sum((tl.cumsum(total, 0) < t).to(tl.int32), 0)
    return tl.maximum(255 - above, 0), t - tl.sum(tl.where(j < above, total, 0), 0)


def _step_kernel(x_ptr, temp_ptr, k_ptr, p_ptr, pmax_ptr, z_ptr, part_ptr, st_ptr, thr_ptr, N, V, NC, CH, ROWS,
                 STEP: tl.constexpr, D: tl.constexpr, HI: tl.constexpr, BLOCK: tl.constexpr,
                 FRAC: tl.constexpr, PDL: tl.constexpr):
    LO: tl.constexpr = 256 // HI
    TOPP: tl.constexpr = STEP >= 4
    LEVEL: tl.constexpr = STEP % 4
    g, c = tl.program_id(0), tl.program_id(1)
    pdl_wait(PDL)
    r = g // N
    temp = tl.load(temp_ptr + r)
    k = tl.load(k_ptr + r)
    p = tl.load(p_ptr + r)
    use_k = (temp > 0) & (k > 0) & (k < V)
    use_p = (temp > 0) & (p < 1.0)
    # st[s, g] = (prefix, target) chosen by step s (st[4, g]: the top-k key) for step s's histogram
    st = st_ptr + g.to(tl.int64) * 2
    # two partials buffers in turn: a step writes the one its predecessor's predecessor wrote,
    # after the wait for its predecessor (which read it) to finish
    part = part_ptr + ROWS.to(tl.int64) * NC * 256 * (STEP % 2)
    part_prev = part_ptr + ROWS.to(tl.int64) * NC * 256 * ((STEP + 1) % 2)
    kkey = tl.full([], -2147483648, tl.int32)
    m = tl.full([], float("-inf"), tl.float32)
    if TOPP:
        cc = tl.arange(0, 64)
        c0 = 0
        while c0 < NC:
            cm = tl.load(pmax_ptr + g.to(tl.int64) * NC + c0 + cc, mask=c0 + cc < NC, other=float("-inf"))
            m = tl.maximum(m, tl.max(cm, 0))
            c0 += 64
    if STEP > 4:
        kkey = tl.load(st_ptr + (4 * ROWS + g.to(tl.int64)) * 2).to(tl.int32)

    # the previous step's choice
    pre = tl.full([], 0, tl.int32)
    t = tl.full([], 0, tl.int64)
    b = tl.full([], 0, tl.int32)
    if STEP > 0:
        prev_active = use_k if STEP <= 4 else use_p
        if prev_active:
            total = chunk_totals(part_prev, g, NC)
            if STEP == 1:
                t = k.to(tl.int64)
            elif STEP == 5:   # a logit is kept iff fewer than ceil(p * Z) mass units are above it
                z = chunk_sum(z_ptr, g, NC).to(tl.float64)
                t = tl.maximum(tl.ceil(p.to(tl.float64) * z).to(tl.int64), 1)
            else:
                pre = tl.load(st_ptr + ((STEP - 1) * ROWS + g.to(tl.int64)) * 2).to(tl.int32)
                t = tl.load(st_ptr + ((STEP - 1) * ROWS + g.to(tl.int64)) * 2 + 1)
            b, t = choose_bin(total, t)
            if STEP == 1 or STEP == 5:
                pre = b - 128
            else:
                pre = (pre << 8) | b
            if STEP == 4:
                kkey = pre
        if STEP < 8:
            if c == 0:
                tl.store(st + STEP * ROWS * 2, pre.to(tl.int64) if STEP != 4 else kkey.to(tl.int64))
                tl.store(st + STEP * ROWS * 2 + 1, t)

    if STEP == 8:
        thr = tl.where(use_k, key_value(kkey), float("-inf"))
        thr = tl.where(use_p & (m > float("-inf")), key_value(pre), thr)
        tl.store(thr_ptr + g, tl.where(temp > 0, thr, float("-inf")))
    else:
        active = use_p if TOPP else use_k
        scan = active
        if LEVEL > 0:   # no entry of this chunk in the chosen bin: no reading
            if active:
                scan = tl.load(part_prev + (g.to(tl.int64) * NC + c) * 256 + b) > 0
        if STEP == 4:   # nor where the chunk's max is below the top-k key
            if active:
                top = tl.load(pmax_ptr + g.to(tl.int64) * NC + c)
                scan = (ordered_key(top) >= kkey) & (top > float("-inf"))
        acc = tl.zeros([D * HI, LO], tl.int32)
        cmax = tl.full([], float("-inf"), tl.float32)
        zsum = tl.full([], 0, tl.int64)
        # No logit whose scaled distance below the max is under `low` can be the top-p threshold:
        # at most V logits lie at or below it and hold >= (1 - p) of the mass, so its own mass is
        # > (1 - p) / (2V) of the max's; `low` is e (one nat) below that, for exp's rounding. Such
        # logits count in Z (zsum) but enter no histogram, so blocks of them skip the product.
        low = tl.log(tl.maximum(1.0 - p, 1e-30) / (2.0 * V)) - 1.0   # (p = 1: unused)
        if scan | (use_p & (STEP == 0)):
            row = x_ptr + g.to(tl.int64) * V
            shift: tl.constexpr = 24 - 8 * LEVEL
            start = c * CH
            end = tl.minimum(start + CH, V)
            tok = start + tl.arange(0, BLOCK)
            x_next = tl.load(row + tok, mask=tok < end, other=float("-inf"))
            while start < end:
                tok = start + tl.arange(0, BLOCK)
                x = x_next.to(tl.float32)
                # the next block's load in flight during this one's histogram
                x_next = tl.load(row + tok + BLOCK, mask=tok + BLOCK < end, other=float("-inf"))
                if STEP == 0:
                    cmax = tl.maximum(cmax, tl.max(x, 0))
                if scan:
                    s = ordered_key(x)
                    match = tok < end
                    if LEVEL > 0:
                        match &= (s >> (shift + 8)) == pre
                    digit = (s >> shift) & 255
                    if LEVEL == 0:
                        digit ^= 128
                    if TOPP:
                        sc = (x - m) / temp
                        w = tl.where(x > float("-inf"), tl.exp(sc), 0.0)
                        mass = (w * (2.0 ** FRAC)).to(tl.int64)
                        match &= (mass > 0) & (s >= kkey)
                        if STEP == 4:
                            zsum += tl.sum(tl.where(match, mass, 0), 0)
                        match &= sc >= low
                    if tl.max(match.to(tl.int32), 0) > 0:
                        # a[d * HI + h, i]: 7-bit digit d of entry i's mass (count: 1) where its
                        # bin's high bits are h
                        j = tl.arange(0, D * HI)[:, None]
                        if TOPP:
                            units = ((mass[None, :] >> (7 * (j // HI))) & 127).to(tl.int8)
                        else:
                            units = tl.full([D * HI, BLOCK], 1, tl.int8)
                        hi = tl.where(match, digit // LO, HI)
                        a = tl.where(hi[None, :] == j % HI, units, 0).to(tl.int8)
                        one_hot = ((digit % LO)[:, None] == tl.arange(0, LO)[None, :]).to(tl.int8)
                        acc = tl.dot(a, one_hot, acc, out_dtype=tl.int32)
                start += BLOCK
        if STEP == 0:
            if use_p:
                tl.store(pmax_ptr + g.to(tl.int64) * NC + c, cmax)
        if STEP == 4:
            if use_p:
                tl.store(z_ptr + g.to(tl.int64) * NC + c, zsum)
        if active:
            wide = tl.reshape(acc.to(tl.int64), [D, HI * LO])
            hist = tl.sum(wide << (7 * tl.arange(0, D)).to(tl.int64)[:, None], 0)
            tl.store(part + (g.to(tl.int64) * NC + c) * 256 + tl.arange(0, 256), hist)


def chunk_plan(rows: int, V: int, chunk: int | None = None) -> tuple[int, int]:
    """(chunks per row, entries per chunk): see MIN_CHUNK."""
    if chunk is None:
        chunk = min(max(1 << (max(V * rows // SPREAD, 1).bit_length() - 1), MIN_CHUNK), MAX_CHUNK)
    chunk = cdiv(chunk, max(BLOCKS)) * max(BLOCKS)
    return cdiv(V, chunk), chunk


def filter_thresholds_fused(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            interpret: bool = False, chunk: int | None = None) -> torch.Tensor:
    """`sampling.filter_thresholds` in 9 launches: thr [R, N] float32 of logits [R, N, V] (fp32
    or bf16) at temperature temp [R], top_k [R] (0: off), top_p [R] (1: off)."""
    R, N, V = logits.shape
    if V >= MAX_VOCAB:
        raise ValueError(f"a vocabulary of {V} (at most {MAX_VOCAB - 1})")
    dev, rows = logits.device, R * N
    nc, ch = chunk_plan(rows, V, chunk)
    x = logits.contiguous()
    pmax = torch.empty(rows, nc, dtype=torch.float32, device=dev)
    z = torch.empty(rows, nc, dtype=torch.int64, device=dev)
    part = torch.empty(2, rows, nc, 256, dtype=torch.int64, device=dev)
    st = torch.empty(8, rows, 2, dtype=torch.int64, device=dev)
    thr = torch.empty(R, N, dtype=torch.float32, device=dev)
    args = (x, temp.float().contiguous(), top_k.long().contiguous(), top_p.float().contiguous(), pmax, z, part, st,
            thr, N, V, nc, ch, rows)
    kernel = jit_kernel(_step_kernel, interpret, ("N", "NC", "ROWS"))
    pdl = pdl_options(dev)
    for step in range(9):
        topp = step >= 4
        kernel[(rows, nc if step < 8 else 1)](*args, STEP=step, D=8 if topp else 1, HI=8 if topp else 16,
                                              BLOCK=BLOCKS[topp], FRAC=FRAC_BITS, num_warps=4, **pdl)
    return thr
