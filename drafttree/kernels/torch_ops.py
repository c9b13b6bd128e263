"""The torch fallbacks of the Triton kernels: what each kernel computes, in torch ops (compiled on
CUDA where `fused` says so). They run where a kernel does not (CPU, fp32 projections, older GPUs,
a kernel family turned off in the settings, shapes past a kernel's limits) and are the reference
the kernel tests compare against. `dispatch` chooses between the two.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from drafttree.kernels.fused import fused

# -- norms and the MLP's activation ----------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


rms_norm = fused(_rms_norm)


@fused
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + delta
    return x, _rms_norm(x, weight, eps)


@fused
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- projections (gemv_kernel, gemm_kernel) --------------------------------------------------------


def projection(kind: str, x: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor | None, eps: float,
               w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused projection (`dispatch.norm_gemv`, `gemv`, `norm_glu_gemv`) as the unfused layers
    compute it: add + norm, cuBLAS, SiLU·up."""
    h = x
    if g is not None:
        x, h = add_rms_norm(x, delta, g, eps) if delta is not None else (x, rms_norm(x, g, eps))
    y = F.linear(h, w, b)
    return x, silu_mul(y) if kind == "glu" else y


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 weights q [N, K] with a scale per row, widened to `dtype`."""
    return (q.float() * scale[:, None]).to(dtype)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ (q * scale).T + b, the weights widened to x's dtype for cuBLAS."""
    return F.linear(x, dequantize(q, scale, x.dtype), b)


# -- rope and the KV write (rope_kernel, attn_kernel) ----------------------------------------------


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


apply_rope = fused(_rope)


@fused
def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(q, cos, sin), _rope(k, cos, sin)


@fused
def norm_rope_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm and rope, for q and k, in one kernel."""
    return _rope(_rms_norm(q, q_weight, eps), cos, sin), _rope(_rms_norm(k, k_weight, eps), cos, sin)


def qk_rope(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k normed (with weights) and roped, and v, [B, W, heads, hd] views or copies, from the
    fused QKV output qkv [B, W, (H + 2 Hkv) * hd]: `rope_kernel`'s work before its KV write."""
    B, W, C = qkv.shape
    hd = C // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = q.view(B, W, heads, hd), k.view(B, W, kv_heads, hd), v.view(B, W, kv_heads, hd)
    if q_weight is not None:
        q, k = norm_rope_qk(q, k, q_weight, k_weight, eps, cos, sin)
    else:
        q, k = rope_qk(q, k, cos, sin)
    return q, k, v


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[rows[b], :, slots[b, i]] = k[b, i], and the same for v."""
    k_cache[rows, :, slots] = k
    v_cache[rows, :, slots] = v


# -- attention (attn_kernel) -----------------------------------------------------------------------


def gather_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A paged pool [1, Hkv, S, hd] read at slots [B, L]: [B, Hkv, L, hd] (a copy)."""
    return pool[0][:, slots].transpose(0, 1)


@fused
def masked_softmax(s: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    p = (s.float() * scale).masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return p.to(s.dtype)


def small_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention for few query rows (decode, draft, verify): two cuBLAS matmuls in the cache's
    dtype around one fused softmax. The fused SDPA kernels spent ~80 us per call on a 1-row
    query over a long masked cache; compiling the matmuls too made them fp32 GEMVs (~80 us)."""
    p = masked_softmax(torch.matmul(q, k.transpose(-1, -2)), mask, scale)
    return torch.matmul(p, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouped_mask: torch.Tensor, scale: float,
              few_rows: bool) -> torch.Tensor:
    """softmax(q kᵀ * scale, masked) v: q [B, W, H, hd]; k, v [B, Hkv, L, hd]; grouped_mask
    [B, 1, g * W, L] (g = H / Hkv query heads per KV head). -> [B, W, H * hd]. `few_rows`: by
    `small_attention`, else by SDPA. GQA without repeating K/V: the g query heads of a group
    become g * W query rows."""
    B, W, H, hd = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qg = q.view(B, W, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * W, hd)
    if few_rows:
        out = small_attention(qg, k, v, grouped_mask, scale)
    else:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=grouped_mask, scale=scale)
    return out.view(B, Hkv, g, W, hd).permute(0, 3, 1, 2, 4).reshape(B, W, H * hd)


# -- the draft tree's top-K (topk_kernel) ----------------------------------------------------------


def chunked_topk(x: torch.Tensor, k: int, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` in two passes: the top k of each `chunk`-wide slice, then the top k
    of those. The same values; on a GPU a few long rows are slow for one topk, many short ones
    are not. Rows of fewer than 4 chunks, or k > chunk, take the plain path."""
    V = x.shape[-1]
    if V < 4 * chunk or k > chunk:
        return x.topk(k, dim=-1)
    n = -(-V // chunk)
    xp = F.pad(x, (0, n * chunk - V), value=float("-inf")).view(*x.shape[:-1], n, chunk)
    v1, i1 = xp.topk(k, dim=-1)
    i1 = i1 + torch.arange(0, n * chunk, chunk, device=x.device)[:, None]
    val, j = v1.flatten(-2).topk(k, dim=-1)
    # a padding column can only win among -inf scores (never-valid nodes); keep its id in range
    return val, i1.flatten(-2).gather(-1, j).clamp_(max=V - 1)


def top_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best tokens per position and their log-probabilities, [R, L, k] each, descending."""
    logits = draft_logits.float()
    top_val, top_idx = chunked_topk(logits, k) if logits.is_cuda else logits.topk(k, dim=-1)
    # logsumexp, reusing the row max that topk already found.
    row_max = top_val[..., :1]
    lse = (logits - row_max).exp_().sum(-1, keepdim=True).log_() + row_max
    return top_val - lse, top_idx


# -- the sampler's top-k / top-p threshold (filter_kernel) -----------------------------------------


def thresholds_by_sort(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """`sampling.filter_thresholds` in torch ops, by a sort of every row's logits."""
    R, N, V = logits.shape
    x = logits.float().sort(dim=-1, descending=True).values
    sampled = temp > 0
    use_k = (sampled & (top_k > 0) & (top_k < V))[:, None]
    kth = x.gather(-1, (top_k.long().clamp(1, V) - 1)[:, None, None].expand(R, N, 1))
    thr_k = torch.where(use_k[..., None], kth, float("-inf"))
    top = x[..., :1]
    w = torch.where((x >= thr_k) & (x > float("-inf")),
                    ((x - top) / torch.where(sampled, temp, 1.0)[:, None, None]).exp(), 0.0).double()
    # the mass of strictly greater logits: the mass before the first of each run of equal ones
    before = w.cumsum(-1) - w
    rank = torch.arange(V, device=x.device)
    first = torch.where(torch.cat([torch.ones_like(x[..., :1], dtype=torch.bool), x[..., 1:] != x[..., :-1]], -1),
                        rank, 0).cummax(-1).values
    kept = (before.gather(-1, first) < top_p.double()[:, None, None] * w.sum(-1, keepdim=True)).sum(-1, keepdim=True)
    thr_p = x.gather(-1, (kept - 1).clamp(min=0))
    use_p = (sampled & (top_p < 1.0))[:, None, None] & (top > float("-inf"))
    return torch.where(use_p, thr_p, thr_k).squeeze(-1)


# -- MoE routing ------------------------------------------------------------------------------------


@fused
def sigmoid_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing from the router's fp32 logits [N, E]: sigmoid scores; the correction
    bias moves the selection only (keep `topk_group` of `n_group` groups by their best two, then
    top-k inside); the weights are the unbiased scores (normalised if `norm`) times `scale`.
    -> (weights [N, k] fp32, ids [N, k] long). At a decode's rows these are a dozen tiny kernels
    a layer, which compile into a few."""
    scores = logits.sigmoid()
    choice = scores + bias
    if topk_group < n_group:
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)              # [N, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
    idx = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


@fused
def local_pairs(w: torch.Tensor, idx: torch.Tensor, first: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs of one rank's experts first .. first + num_local - 1 renumbered from 0;
    another rank's pair gets id num_local and weight 0 (static shapes: every pair stays)."""
    rel = idx - first
    mine = (rel >= 0) & (rel < num_local)
    return w.masked_fill(~mine, 0.0), torch.where(mine, rel, num_local)
