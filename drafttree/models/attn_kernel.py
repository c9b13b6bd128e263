"""Few-query-row attention (decode, draft, verify) over the head-major KV cache, in two Triton
launches: split-K flash-decoding, then a merge of the splits.

Replaces QKᵀ, the masked softmax and PV (three kernels, and a [rows, L] score matrix written to
and read back from memory) at every layer of every decode, draft and verify step. Key blocks
that no query row may see are skipped, so a graph captured at a 2,048-slot bucket reads only
the cache a request has filled.

Layout (see `layers.cached_attention`): q [B, Hkv, M, hd], where the M = g * W query rows of a
KV head are its g query heads times W tokens, row m being token m % W; the cache is
[rows, Hkv, max_len, hd]; mask [B, 1, W, L] bool, True where a token may see a cache entry.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from drafttree.triton_jit import interpreting, jit_kernel, kernels_run_on, next_pow2

tl: Any = None  # triton.language, bound by triton_jit.jit_kernel()

# DRAFTTREE_ATTN_KERNEL=0 keeps the cuBLAS + fused-softmax path (for A/B benchmarks).
ENABLED = os.environ.get("DRAFTTREE_ATTN_KERNEL", "1") != "0"
BLOCK_N = 64          # keys per inner step
MAX_BLOCK_M = 64      # query rows per program; more rows take more programs
# Keys per split program: a fixed number, so that the split kernel compiles once per model and
# row block, whatever the KV bucket; a 1,024-slot bucket at batch 1 makes 4 splits per KV head.
SPLIT_LEN = 4 * BLOCK_N


def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, ml_ptr, M, W, L, NS, NMB,
                  skr, skh, skl, svr, svh, svl, smb, smw, scale, S_LEN: tl.constexpr,
                  HKV: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  PREC: tl.constexpr):
    pid, sp = tl.program_id(0), tl.program_id(1)
    bh, mb = pid // NMB, pid % NMB
    b, h = bh // HKV, bh % HKV
    m = mb * BM + tl.arange(0, BM)
    m_ok = m < M
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (bh * M + m[:, None]) * HD + d[None, :], mask=m_ok[:, None], other=0.0)
    w = m % W
    k_base = k_ptr + b.to(tl.int64) * skr + h * skh
    v_base = v_ptr + b.to(tl.int64) * svr + h * svh
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HD], tl.float32)
    for j in range(0, S_LEN, BN):   # S_LEN is whole blocks: splits do not overlap
        n = sp * S_LEN + j + tl.arange(0, BN)
        n_ok = n < L
        vis = tl.load(mask_ptr + b * smb + w[:, None] * smw + n[None, :],
                      mask=m_ok[:, None] & n_ok[None, :], other=0) != 0
        if tl.max(tl.max(vis.to(tl.int32), 1), 0) > 0:   # a block no row sees is not read
            k = tl.load(k_base + n[:, None] * skl + d[None, :], mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * svl + d[None, :], mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
    part = (bh * NS + sp) * M + m
    tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=m_ok[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=m_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=m_ok)


def _merge_kernel(acc_ptr, ml_ptr, o_ptr, M, NS, NS_PAD: tl.constexpr, HD: tl.constexpr):
    row = tl.program_id(0)          # (b * Hkv + h) * M + m
    bh, m = row // M, row % M
    sp = tl.arange(0, NS_PAD)
    part = (bh * NS + sp) * M + m
    ok = sp < NS
    m_s = tl.load(ml_ptr + part * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m_s, 0)
    f = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - top))
    d = tl.arange(0, HD)
    acc = tl.load(acc_ptr + part[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(f[:, None] * acc, 0) / tl.sum(f * l_s, 0)
    tl.store(o_ptr + row * HD + d, out.to(o_ptr.dtype.element_ty))


def usable(q: torch.Tensor) -> bool:
    """Whether `few_row_attention` runs for q [B, Hkv, M, hd]: enabled, Triton there, and a
    head dim `tl.dot` takes (a power of two, at least 16)."""
    hd = q.shape[-1]
    return ENABLED and hd >= 16 and hd == next_pow2(hd) and kernels_run_on(q.device)


def few_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """softmax(q kᵀ * scale, masked) v for q [B, Hkv, M, hd]; k, v [B, Hkv, L, hd] views of the
    cache (last dim contiguous); mask [B, 1, W, L] bool with M a multiple of W. -> [B, Hkv, M, hd]."""
    B, Hkv, M, hd = q.shape
    L, W = k.shape[2], mask.shape[2]
    if M % W or mask.shape[-1] != L or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"few_row_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, mask {tuple(mask.shape)}")
    q = q.contiguous()
    mask = mask.contiguous().view(torch.uint8)
    bm = min(MAX_BLOCK_M, max(16, next_pow2(M)))
    nmb = -(-M // bm)
    ns = -(-L // SPLIT_LEN)
    acc = torch.empty(B * Hkv * ns * M, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * Hkv * ns * M, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    interpret = interpreting()
    jit_kernel(_split_kernel, interpret)[(B * Hkv * nmb, ns)](
        q, k, v, mask, acc, ml, M, W, L, ns, nmb,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(2), scale, S_LEN=SPLIT_LEN, HKV=Hkv, HD=hd, BM=bm, BN=BLOCK_N,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)  # fp32 stays fp32
    jit_kernel(_merge_kernel, interpret)[(B * Hkv * M,)](acc, ml, out, M, ns, NS_PAD=max(2, next_pow2(ns)),
                                                         HD=hd, num_warps=2)
    return out
