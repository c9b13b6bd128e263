"""Few-query-row attention (decode, draft, verify) over the head-major KV cache, in two Triton
launches: split-K flash-decoding, then a merge of the splits; and the KV write before it in one.
For one-token decodes the split launch also does `rope_kernel`'s work (`rope_attention`).

Replaces QKᵀ, the masked softmax and PV (three kernels, and a [rows, L] score matrix written to
and read back from memory) at every layer of every decode, draft and verify step. Key blocks
that no query row may see are skipped, so a graph captured at a 2,048-slot bucket reads only
the cache a request has filled.

Layout: q and the output stay token-major, [B, W, H, hd], as the projections make and take
them (no permute copies); a KV head's M = g * W query rows are its g query heads times W
tokens, row m being token m % W of query head h * g + m // W. The cache is
[rows, Hkv, max_len, hd]; mask [B, 1, W, L] bool, True where a token may see a cache entry.
Paged (`kv_slots` [B, L]): the cache is one pool [1, Hkv, slots, hd] and row b's position n is
read from slot kv_slots[b, n] (the block table's slot mapping), without gathering a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from drafttree.kernels.rope_kernel import norm_rope
from drafttree.kernels.triton_jit import device_function, interpreting, jit_kernel, next_pow2, pdl_options, pdl_wait

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

BLOCK_N = 64          # keys per inner step
MAX_BLOCK_M = 64      # query rows per program; more rows take more programs
# fp32 (exact `ieee` dots) at 64 rows made a graphed DFlash round of the SmolLM2 shape 6.9 ms
# against 2.6 at 16 (H200)
MAX_BLOCK_M_FP32 = 16
# Splits are sized so that a launch has about TARGET_PROGRAMS programs: a decode at batch 1 has
# only Hkv programs per split, and one program's key blocks run one after another (a block's
# mask, then its K and V, then the dots), so few long programs are latency-bound. Blocks per
# split is a power of two up to MAX_SPLIT_BLOCKS: a handful of compiled variants per model.
TARGET_PROGRAMS = 264  # two waves of an H200's 132 SMs
MAX_SPLIT_BLOCKS = 16
MAX_SPLITS = 64       # the merge holds [splits, hd] partials per query row


@device_function
def _roped(src, t, ok, w_ptr, cos_ptr, sin_ptr, eps, HD: tl.constexpr, NORM: tl.constexpr):
    """`norm_rope` of the head rows starting at src [R] (token ids t, rows `ok`), in the model dtype."""
    d = tl.arange(0, HD)
    d_rot = (d + HD // 2) % HD
    x = tl.load(src[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    xr = tl.load(src[:, None] + d_rot[None, :], mask=ok[:, None], other=0.0)
    cos = tl.load(cos_ptr + t[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    w, wr = cos, sin   # the norm's weights, read with NORM only (a name keeps its type across an if)
    if NORM:
        w, wr = tl.load(w_ptr + d)[None, :].to(tl.float32), tl.load(w_ptr + d_rot)[None, :].to(tl.float32)
    return norm_rope(x, xr, w, wr, cos, sin, eps, HD, NORM).to(x.dtype)


def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, ml_ptr, o_ptr, M, W, G, L, NS, NMB,
                  sqb, sqw, sqh, skr, skh, skl, svr, svh, svl, smb, smw, scale,
                  qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, eps, kvs_ptr, pos_ptr,
                  SPLIT_BLOCKS: tl.constexpr,
                  HKV: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  PREC: tl.constexpr, DIRECT: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
                  W_PAD: tl.constexpr, PAGED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid, sp = tl.program_id(0), tl.program_id(1)
    bh, mb = pid // NMB, pid % NMB
    b, h = bh // HKV, bh % HKV
    m = mb * BM + tl.arange(0, BM)
    m_ok = m < M
    d = tl.arange(0, HD)
    w = m % W                     # row m is token w of query head h * G + m // W
    k_base = k_ptr + b.to(tl.int64) * skr + h * skh
    v_base = v_ptr + b.to(tl.int64) * svr + h * svh
    if ROPE:   # q_ptr is the fused QKV output [B, W, (H + 2 Hkv) * hd]: `rope_kernel`'s work here
        t = b * W + w
        q = _roped(q_ptr + t.to(tl.int64) * sqw + (h * G + m // W) * HD, t, m_ok, qw_ptr, cos_ptr, sin_ptr, eps,
                   HD, NORM)
        # The new tokens' k and v whose slots lie in this split's keys are written by this
        # split's programs (only they read those slots), before their key loop.
        i = tl.arange(0, W_PAD)
        ti = b * W + i
        slot = tl.load(slot_ptr + ti, mask=i < W, other=-1).to(tl.int64)
        at = slot   # the position the split's keys are counted in: the slot, or paged the position
        if PAGED:
            at = tl.load(pos_ptr + ti, mask=i < W, other=-1).to(tl.int64)
        lo = sp * SPLIT_BLOCKS * BN
        mine = (i < W) & (at >= lo) & (at < lo + SPLIT_BLOCKS * BN)
        if tl.max(mine.to(tl.int32), 0) > 0:
            k_src = q_ptr + ti.to(tl.int64) * sqw + (HKV * G + h) * HD
            tl.store(k_base + slot[:, None] * skl + d[None, :],
                     _roped(k_src, ti, mine, kw_ptr, cos_ptr, sin_ptr, eps, HD, NORM), mask=mine[:, None])
            tl.store(v_base + slot[:, None] * svl + d[None, :],
                     tl.load(k_src[:, None] + HKV * HD + d[None, :], mask=mine[:, None], other=0.0), mask=mine[:, None])
            tl.debug_barrier()   # the writes are seen by this program's loads below
    else:
        q = tl.load(q_ptr + b * sqb + w[:, None] * sqw + (h * G + m[:, None] // W) * sqh + d[None, :],
                    mask=m_ok[:, None], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HD], tl.float32)
    for j in range(SPLIT_BLOCKS):   # splits are whole blocks and do not overlap
        n = (sp * SPLIT_BLOCKS + j) * BN + tl.arange(0, BN)
        n_ok = n < L
        vis = tl.load(mask_ptr + b * smb + w[:, None] * smw + n[None, :],
                      mask=m_ok[:, None] & n_ok[None, :], other=0) != 0
        if tl.max(tl.max(vis.to(tl.int32), 1), 0) > 0:   # a block no row sees is not read
            at_n = n.to(tl.int64)
            if PAGED:
                at_n = tl.load(kvs_ptr + b.to(tl.int64) * L + n, mask=n_ok, other=0).to(tl.int64)
            k = tl.load(k_base + at_n[:, None] * skl + d[None, :], mask=n_ok[:, None], other=0.0)
            v = tl.load(v_base + at_n[:, None] * svl + d[None, :], mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
    if DIRECT:   # one split: what the merge would compute (f = 1), written token-major
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]   # rows past M (masked) saw nothing
        tl.store(o_ptr + ((b * W + w[:, None]) * HKV * G + h * G + m[:, None] // W) * HD + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        part = (bh * NS + sp) * M + m
        seen = m_ok & (m_i > float("-inf"))   # the merge reads acc only where the split saw a key
        tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=seen[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=m_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=m_ok)


def _merge_kernel(acc_ptr, ml_ptr, o_ptr, M, W, G, HKV, NS, NS_PAD: tl.constexpr,
                  HD: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)          # (b * Hkv + h) * M + m
    bh, m = row // M, row % M
    b, h = bh // HKV, bh % HKV
    sp = tl.arange(0, NS_PAD)
    part = (bh * NS + sp) * M + m
    ok = sp < NS
    m_s = tl.load(ml_ptr + part * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m_s, 0)
    f = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - top))
    d = tl.arange(0, HD)
    acc = tl.load(acc_ptr + part[:, None] * HD + d[None, :], mask=(f > 0)[:, None], other=0.0)
    out = tl.sum(f[:, None] * acc, 0) / tl.sum(f * l_s, 0)
    head = h * G + m // W            # out [B, W, H, hd], contiguous
    tl.store(o_ptr + ((b * W + m % W) * HKV * G + head) * HD + d, out.to(o_ptr.dtype.element_ty))


def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, row_ptr, slot_ptr, W, HKV,
                     skb, skw, skh, svb, svw, svh, kcr, kch, kcl, vcr, vch, vcl,
                     HKV_PAD: tl.constexpr, HD: tl.constexpr):
    t = tl.program_id(0)   # token (b, i) of the forward, t = b * W + i
    b, i = t // W, t % W
    row = tl.load(row_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HKV_PAD)[:, None]
    d = tl.arange(0, HD)[None, :]
    ok = h < HKV
    k = tl.load(k_ptr + b * skb + i * skw + h * skh + d, mask=ok)
    v = tl.load(v_ptr + b * svb + i * svw + h * svh + d, mask=ok)
    tl.store(kc_ptr + row * kcr + h * kch + slot * kcl + d, k, mask=ok)
    tl.store(vc_ptr + row * vcr + h * vch + slot * vcl + d, v, mask=ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[rows[b], :, slots[b, i]] = k[b, i] and the same for v, in one launch.
    Caches [rows, Hkv, max_len, hd]; k, v [B, W, Hkv, hd] (last dim contiguous); rows [B, 1]."""
    B, W, Hkv, hd = k.shape
    slots = slots.contiguous()
    jit_kernel(_kv_write_kernel, interpreting(), ("W", "HKV"))[(B * W,)](
        k, v, k_cache, v_cache, rows.reshape(B).contiguous(), slots, W, Hkv,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV_PAD=next_pow2(Hkv), HD=hd, num_warps=1)


def plan_split_blocks(programs: int, L: int) -> int:
    """Key blocks per split for `programs` (batch x KV heads x row blocks) over L keys; past
    MAX_SPLITS splits (very long contexts) the splits grow, so that the merge stays small."""
    blocks = -(-L // BLOCK_N)
    per_split = -(-blocks * programs // TARGET_PROGRAMS)
    return max(min(MAX_SPLIT_BLOCKS, next_pow2(per_split)), next_pow2(-(-blocks // MAX_SPLITS)))


def few_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, kv_slots: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ * scale, masked) v with grouped query heads, read and written token-major:
    q [B, W, H, hd] (any strides, last dim contiguous); k, v [B, Hkv, L, hd] views of the cache
    (last dim contiguous), or with kv_slots [B, L] the pools [1, Hkv, slots, hd]; mask [B, 1, W, L]
    bool. -> [B, W, H, hd], contiguous."""
    return _attention(q, q.shape[2], k, v, mask, scale, None, kv_slots)


@dataclass
class Rope:
    """What `rope_attention` does to the fused QKV output first, as `rope_kernel` does."""
    q_weight: torch.Tensor | None   # per-head q/k RMSNorm weights (Qwen3), or None
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor               # [B, W, 1, hd]
    sin: torch.Tensor
    slots: torch.Tensor             # [B, W]: where the new tokens' k and v go in the cache views
    positions: torch.Tensor | None = None   # [B, W], paged: the new tokens' positions (slots are pool slots)


def rope_attention(qkv: torch.Tensor, heads: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float, rope: Rope, kv_slots: torch.Tensor | None = None) -> torch.Tensor:
    """`few_row_attention` from the fused QKV output qkv [B, W, (H + 2 Hkv) * hd], in the same
    launches: q and k normed (if weights) and roped, k and v written to k, v [B, Hkv, L, hd] (views
    of the cache, rows 0..B-1) at `rope.slots`. One launch per layer fewer than `rope_kernel`, but
    every split recomputes its query rows' rope: worth it for decode tokens only (a DDTree verify at
budget 32 lost more than decode gained). Paged (kv_slots): k, v are the pools, rope.slots pool
    slots and rope.positions the new tokens' positions."""
    return _attention(qkv.contiguous(), heads, k, v, mask, scale, rope, kv_slots)


def _attention(q: torch.Tensor, H: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               rope: Rope | None, kv_slots: torch.Tensor | None = None) -> torch.Tensor:
    B, W, hd = q.shape[0], q.shape[1], k.shape[-1]
    paged = kv_slots is not None
    Hkv, L = k.shape[1], (kv_slots.shape[1] if paged else k.shape[2])
    if paged and (k.shape[0] != 1 or tuple(kv_slots.shape) != (B, L) or (rope is not None and rope.positions is None)):
        raise ValueError(f"few_row_attention (paged): k {tuple(k.shape)}, kv_slots {tuple(kv_slots.shape)}")
    fits = q.shape[2] == H if rope is None else q.dim() == 3 and q.shape[2] == (H + 2 * Hkv) * hd
    if not fits or H % Hkv or tuple(mask.shape) != (B, 1, W, L) or q.stride(-1) != 1 or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        raise ValueError(f"few_row_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, mask {tuple(mask.shape)}")
    G = H // Hkv
    M = G * W
    mask = mask.contiguous().view(torch.uint8)
    bm = min(MAX_BLOCK_M_FP32 if q.dtype == torch.float32 else MAX_BLOCK_M, max(16, next_pow2(M)))
    nmb = -(-M // bm)
    split_blocks = plan_split_blocks(B * Hkv * nmb, L)
    ns = -(-L // (split_blocks * BLOCK_N))
    out = torch.empty(B, W, H, hd, dtype=q.dtype, device=q.device)
    direct = ns == 1   # large batches: one split per program, no merge launch
    acc = out if direct else torch.empty(B * Hkv * ns * M, hd, dtype=torch.float32, device=q.device)
    ml = out if direct else torch.empty(B * Hkv * ns * M, 2, dtype=torch.float32, device=q.device)
    norm = rope is not None and rope.q_weight is not None
    r = (rope.q_weight if norm else q, rope.k_weight if norm else q, rope.cos.contiguous(), rope.sin.contiguous(),
         rope.slots.contiguous(), rope.eps) if rope is not None else (q, q, q, q, q, 0.0)
    kvs = kv_slots.contiguous() if paged else q
    pos = rope.positions.contiguous() if paged and rope is not None else q
    skr, svr = (0, 0) if paged else (k.stride(0), v.stride(0))   # one pool: every row reads it
    interpret = interpreting()
    pdl = pdl_options(q.device)
    # L (a KV bucket: few values) stays specialized: with it unspecialized and q token-major, a
    # batch-16 verify took 102 us against 56 before both changes; not yet split apart
    jit_kernel(_split_kernel, interpret, ("M", "W", "G", "NS", "NMB"))[(B * Hkv * nmb, ns)](
        q, k, v, mask, acc, ml, out, M, W, G, L, ns, nmb, q.stride(0), q.stride(1), q.stride(2),
        skr, k.stride(1), k.stride(2), svr, v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(2), scale, *r, kvs, pos, SPLIT_BLOCKS=split_blocks, HKV=Hkv, HD=hd, BM=bm,
        BN=BLOCK_N, PREC="ieee" if q.dtype == torch.float32 else "tf32", DIRECT=direct, ROPE=rope is not None,
        NORM=norm, W_PAD=next_pow2(W) if rope is not None else 1, PAGED=paged, num_warps=4, **pdl)  # fp32 stays fp32
    if direct:
        return out
    jit_kernel(_merge_kernel, interpret, ("M", "W", "G", "HKV", "NS"))[(B * Hkv * M,)](acc, ml, out, M, W, G, Hkv, ns,
                                                         NS_PAD=max(2, next_pow2(ns)),
                                                         HD=hd, num_warps=2, **pdl)
    return out
