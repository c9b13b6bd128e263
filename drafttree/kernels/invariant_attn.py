"""Attention in which a query token's output does not depend on the forward that computes it
(deterministic mode): a decode, a DFlash or DDTree verify of any width, a prefill chunk, any
batch, give a token the same bits.

A token's keys are the cache entries its mask lets it see, in increasing position
(`visible_keys`: the run of positions from 0, then a tail of at most the forward's width). For a DDTree node that is its context and then its ancestors (a parent precedes
its children in the tree's order): the same sequence plain decoding gives the token at that
position. The sequence is cut into chunks of CHUNK keys counted from its first, each chunk into
blocks of BLOCK_N; a chunk's online softmax runs block after block (`_chunk`), and the chunks are
folded in order (`_fold`). Neither the tiles (the token's G query heads against BLOCK_N keys),
nor the cuts, nor the order depend on anything but the token's own key count.

Few tokens (decodes, small verifies): a program per (token, KV head, chunk) writes its chunk's
state, and a second launch folds them. Many tokens (wide verifies, prefill): a program per
(token, KV head) runs its chunks and folds them itself. Both run the same two device functions,
compiled without fused multiply-adds, so they give the same bits.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from drafttree.kernels.triton_jit import cdiv, device_function, interpreting, jit_kernel, next_pow2, pdl_options
from drafttree.kernels.triton_jit import pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

BLOCK_N = 64
CHUNK_BLOCKS = 4            # CHUNK = 256 keys
CHUNK = BLOCK_N * CHUNK_BLOCKS
ENOUGH_PROGRAMS = 264       # (token, KV head) programs past which chunks are folded in-program


def takes(head_dim: int) -> bool:
    """Whether the kernel takes heads of `head_dim` (a power of two, at least 16: `tl.dot`'s)."""
    return head_dim >= 16 and head_dim == next_pow2(head_dim)


class Visible(NamedTuple):
    """Each token's visible keys in increasing position, as a prefix and a tail: positions
    0 .. prefix - 1, then tail[:counts - prefix]. [B, W] / [B, W, W] / [B, W] int32."""
    prefix: torch.Tensor
    tail: torch.Tensor
    counts: torch.Tensor


def visible_keys(mask: torch.Tensor) -> Visible:
    """`Visible` of mask [B, 1, W, L] (True: the token sees that position). The prefix is the run
    of visible positions from 0; every visible position after it must lie within the W positions
    that follow it, as in any forward's mask (`models.kv_cache.attn_meta`: a token sees its whole
    context, and among the forward's W new entries the ones it may). So memory is B * W * W, not
    B * W * L."""
    B, _, W, L = mask.shape
    seen = mask[:, 0]
    hidden = ~seen
    prefix = torch.where(hidden.any(-1), hidden.to(torch.uint8).argmax(-1), L)    # the first hidden key
    cols = prefix[..., None] + torch.arange(W, device=mask.device)                  # [B, W, W]
    in_tail = torch.gather(seen, -1, cols.clamp(max=L - 1)) & (cols < L)
    rank = in_tail.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1
    dest = torch.where(in_tail, rank, W).long()      # the others go to a spare column, dropped
    tail = torch.zeros(B, W, W + 1, dtype=torch.int32, device=mask.device)
    tail.scatter_(-1, dest, cols.to(torch.int32))
    prefix = prefix.to(torch.int32)
    return Visible(prefix, tail[..., :W], prefix + in_tail.sum(-1, dtype=torch.int32))


@device_function
def _chunk(q, k_base, v_base, tail_row, kvs_row, n0, prefix, count, skl, svl, scale, HD: tl.constexpr,
           GP: tl.constexpr, BN: tl.constexpr, CB: tl.constexpr, PREC: tl.constexpr, PAGED: tl.constexpr):
    """The online softmax of query rows q [GP, HD] over the token's keys n0 .. n0 + CB * BN - 1
    (those below `count`; key n is position n below `prefix`, else tail_row[n - prefix]; paged,
    read at slot kvs_row[position]): (m [GP], l [GP], acc [GP, HD]), acc not yet divided by l."""
    d = tl.arange(0, HD)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    for j in range(CB):
        n = n0 + j * BN + tl.arange(0, BN)
        ok = n < count
        if n0 + j * BN < count:
            late = n >= prefix
            at = tl.where(late, tl.load(tail_row + (n - prefix), mask=ok & late, other=0), n).to(tl.int64)
            if PAGED:
                at = tl.load(kvs_row + at, mask=ok, other=0).to(tl.int64)
            k = tl.load(k_base + at[:, None] * skl + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_base + at[:, None] * svl + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
    return m_i, l_i, acc


@device_function
def _fold(top, out, den, m_s, l_s, acc_s):
    """The running state (top [GP], out [GP, HD], den [GP]) with the next chunk's state folded in."""
    new = tl.maximum(top, m_s)
    a = tl.exp(top - new)
    f = tl.exp(m_s - new)
    return new, out * a[:, None] + acc_s * f[:, None], den * a + l_s * f


def _attn_kernel(q_ptr, k_ptr, v_ptr, pre_ptr, tail_ptr, cnt_ptr, kvs_ptr, o_ptr, acc_ptr, ml_ptr, W, L, NS,
                 sqb, sqw, sqh, skr, skh, skl, svr, svh, svl, scale,
                 G: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr,
                 CB: tl.constexpr, PREC: tl.constexpr, INLINE: tl.constexpr, PAGED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid, sp = tl.program_id(0), tl.program_id(1)
    t, h = pid // HKV, pid % HKV          # token t = b * W + i
    b, i = t // W, t % W
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    g_ok = g < G
    count = tl.load(cnt_ptr + t)
    prefix = tl.load(pre_ptr + t)
    row = 0 if PAGED else b.to(tl.int64)
    k_base = k_ptr + row * skr + h * skh
    v_base = v_ptr + row * svr + h * svh
    tail_row = tail_ptr + t.to(tl.int64) * W
    kvs_row = kvs_ptr + b.to(tl.int64) * L
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + i * sqw + (h * G + g)[:, None] * sqh + d[None, :],
                mask=g_ok[:, None], other=0.0)
    if INLINE:
        top = tl.full([GP], float("-inf"), tl.float32)
        out = tl.zeros([GP, HD], tl.float32)
        den = tl.zeros([GP], tl.float32)
        n0 = 0
        while n0 < count:
            m_s, l_s, acc_s = _chunk(q, k_base, v_base, tail_row, kvs_row, n0, prefix, count, skl, svl, scale, HD, GP,
                                     BN, CB, PREC, PAGED)
            top, out, den = _fold(top, out, den, m_s, l_s, acc_s)
            n0 += CB * BN
        out = out / tl.where(den > 0, den, 1.0)[:, None]   # a padding token sees nothing
        tl.store(o_ptr + (t.to(tl.int64) * HKV * G + h * G + g)[:, None] * HD + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        if sp * CB * BN < count:
            m_s, l_s, acc_s = _chunk(q, k_base, v_base, tail_row, kvs_row, sp * CB * BN, prefix, count, skl, svl,
                                     scale, HD, GP, BN, CB, PREC, PAGED)
            part = (pid.to(tl.int64) * NS + sp) * G + g
            tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc_s, mask=g_ok[:, None])
            tl.store(ml_ptr + part * 2, m_s, mask=g_ok)
            tl.store(ml_ptr + part * 2 + 1, l_s, mask=g_ok)


def _fold_kernel(cnt_ptr, o_ptr, acc_ptr, ml_ptr, NS, G: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
                 GP: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid = tl.program_id(0)                # (token, KV head)
    t, h = pid // HKV, pid % HKV
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    g_ok = g < G
    count = tl.load(cnt_ptr + t)
    top = tl.full([GP], float("-inf"), tl.float32)
    out = tl.zeros([GP, HD], tl.float32)
    den = tl.zeros([GP], tl.float32)
    c = 0
    while c * CHUNK < count:
        part = (pid.to(tl.int64) * NS + c) * G + g
        m_s = tl.load(ml_ptr + part * 2, mask=g_ok, other=0.0)
        l_s = tl.load(ml_ptr + part * 2 + 1, mask=g_ok, other=0.0)
        acc_s = tl.load(acc_ptr + part[:, None] * HD + d[None, :], mask=g_ok[:, None], other=0.0)
        top, out, den = _fold(top, out, den, m_s, l_s, acc_s)
        c += 1
    out = out / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(o_ptr + (t.to(tl.int64) * HKV * G + h * G + g)[:, None] * HD + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: Visible, scale: float,
              kv_slots: torch.Tensor | None = None, inline: bool | None = None) -> torch.Tensor:
    """softmax(q kᵀ * scale) v over each token's visible keys (`visible_keys`): q [B, W, H, hd]
    (last dim contiguous); k, v [B, Hkv, ≥L, hd] (rows of the cache, last dim contiguous), or the
    pools [1, Hkv, slots, hd] read at kv_slots [B, L] (position -> slot). -> [B, W, H, hd],
    contiguous. `inline`: fold chunks in-program (default: when the (token, KV head) programs reach
    ENOUGH_PROGRAMS); the bits are the same either way."""
    B, W, H, hd = q.shape
    paged = kv_slots is not None
    Hkv = k.shape[1]
    L = kv_slots.shape[1] if paged else k.shape[2]
    rows_ok = k.shape[0] == 1 and tuple(kv_slots.shape) == (B, L) if paged else k.shape[0] >= B
    if H % Hkv or not rows_ok or tuple(visible.tail.shape) != (B, W, W) or tuple(visible.counts.shape) != (B, W) \
            or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or not takes(hd):
        raise ValueError(f"invariant attention: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"tail {tuple(visible.tail.shape)}")
    G = H // Hkv
    programs = B * W * Hkv
    inline = programs >= ENOUGH_PROGRAMS if inline is None else inline
    ns = 1 if inline else cdiv(L, CHUNK)
    out = torch.empty(B, W, H, hd, dtype=q.dtype, device=q.device)
    acc = out if inline else torch.empty(programs * ns * G, hd, dtype=torch.float32, device=q.device)
    ml = out if inline else torch.empty(programs * ns * G, 2, dtype=torch.float32, device=q.device)
    prefix, tail, counts = (t.contiguous() for t in visible)
    kvs = kv_slots.contiguous() if paged else counts
    interpret = interpreting()
    pdl = pdl_options(q.device)
    exact = {} if interpret else {"enable_fp_fusion": False}   # both launches fold with the same roundings
    skr, svr = (0, 0) if paged else (k.stride(0), v.stride(0))
    jit_kernel(_attn_kernel, interpret, ("W", "L", "NS"))[(programs, ns)](
        q, k, v, prefix, tail, counts, kvs, out, acc, ml, W, L, ns, q.stride(0), q.stride(1), q.stride(2),
        skr, k.stride(1), k.stride(2), svr, v.stride(1), v.stride(2), scale,
        G=G, HKV=Hkv, HD=hd, GP=max(16, next_pow2(G)), BN=BLOCK_N, CB=CHUNK_BLOCKS,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", INLINE=inline, PAGED=paged, num_warps=4, **exact, **pdl)
    if not inline:
        jit_kernel(_fold_kernel, interpret, ("NS",))[(programs,)](
            counts, out, acc, ml, ns, G=G, HKV=Hkv, HD=hd, GP=max(16, next_pow2(G)), CHUNK=CHUNK, num_warps=4,
            **exact, **pdl)
    return out
