"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a latent KV cache.

The cache holds, per token, the compressed latent c (kv_lora_rank, after kv_a_layernorm) and the
roped shared key k_pe (qk_rope_head_dim), as one KV head of width kv_lora_rank + qk_rope_head_dim
in the K cache; the V cache has width 0 (`ModelConfig.v_cache_dim`, `kv_cache.KVLayout`). In the
paged pool these entries sit in the request's pages like any K: written at the slot mapping, read
through it (`latents`), the accepted ones moved by tree verify's compaction. Per head h, with
W_UK[h] [nope, r] and W_UV[h] [v, r] the two halves of kv_b_proj:

    score(i, j) = q_nope[i,h] · (W_UK[h] c_j) + q_pe[i,h] · k_pe_j
    out[i, h]   = Σ_j p(i, j) W_UV[h] c_j

Few query rows (decode, draft, verify) take the absorbed form: q_nope W_UK[h] is a query in latent
space, so every head attends over the cache itself as one shared head [c ; k_pe], and W_UV applies
after the attention. Many rows (prefill) take the expanded form: the cache's latents go up through
kv_b_proj to per-head keys and values once, for all query rows. Both take the metadata of dense
attention (slots, the intra-block mask), so tree verify and compaction work unchanged.

Over a tensor-parallel group each rank holds H/N heads (`parallel.shard`): their rows of q_b_proj
(q_proj) and kv_b_proj, their columns of o_proj (row-parallel, one all-reduce). The latent path
(q_a_proj, kv_a_proj_with_mqa, their norms) is whole, so every rank writes the same latent into
its own whole copy of the cache, which all its heads read.

From a quantized checkpoint the projections applied as such (q_a_proj, q_b_proj or q_proj,
kv_a_proj_with_mqa, o_proj) may hold their weights as stored (`models.quant_linear`); kv_b_proj,
which the absorbed form splits into the matrices W_UK and W_UV, is widened at load.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafttree.config import ModelConfig
from drafttree.kernels.torch_ops import masked_softmax, write_kv
from drafttree.models.layers import AttnMeta, RMSNorm
from drafttree.parallel.comm import all_reduce
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import q_span

# Query rows per request up to which attention is absorbed: a verify of budget + 1 <= 128 nodes,
# a draft block, a decode. A prefill chunk wider than this expands the latents instead.
ABSORBED_MAX_ROWS = 128


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rope over x [..., d]. Interleaved: pairs (x0, x1), (x2, x3)... each turn by one frequency,
    and the result is laid out as [evens ; odds] (what the reference does, for q and k alike, so
    their dot products are those of the paired layout). cos, sin [..., d] as cat(freqs, freqs)."""
    half = x.shape[-1] // 2
    if interleaved:
        c, s = cos[..., :half], sin[..., :half]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    a, b = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def latents(k_cache: torch.Tensor, meta: AttnMeta, B: int) -> torch.Tensor:
    """The latent entries rows 0..B-1 attend over, [B, kv_len, cache_dim]: paged, the pool read
    through the slot mapping (a copy); else cache rows 0..B-1 (a view)."""
    if meta.kv_slots is not None:
        return k_cache[0, 0][meta.kv_slots]
    return k_cache[:B, 0, :meta.kv_len]


class MLAttention(nn.Module):
    """Over `tp`, this rank's H/N heads; the latent projections whole."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None and cfg.num_kv_heads == 1 and cfg.head_dim == m.cache_dim, \
            "an MLA config keeps one latent cache head of kv_lora_rank + qk_rope_head_dim"
        world, rank = (tp.world, tp.rank) if tp is not None else (1, 0)
        self.tp = tp
        self.m, self.h = m, q_span(cfg, world, rank)[1]
        D, H, qk = cfg.hidden_size, self.h, m.qk_nope_head_dim + m.qk_rope_head_dim
        bias = cfg.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, m.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        # row-parallel: the ranks' outputs are summed, so the bias is rank 0's alone (added once)
        self.o_proj = nn.Linear(H * m.v_head_dim, D, bias=bias and rank == 0)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[B, W, H, nope + rope], rope not yet applied."""
        q = self.q_proj(x) if self.m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:2], self.h, -1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttnMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x [B, W, D] -> [B, W, D]. k_cache [rows, 1, slots, kv_lora_rank + rope]: this layer's
        latent cache (paged: the pool, rows 1); v_cache [rows, 1, slots, 0]."""
        m, (B, W, _) = self.m, x.shape
        cos, sin = rope                                       # [B, W, 1, rope]
        q = self.query(x)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_pe = rope_pairs(q_pe, cos, sin, m.rope_interleave)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        entry = torch.cat([self.kv_a_layernorm(c), rope_pairs(k_pe, cos[:, :, 0], sin[:, :, 0], m.rope_interleave)],
                          dim=-1)[:, :, None]                 # [B, W, 1, cache_dim]
        assert entry.shape[-1] == k_cache.shape[-1] and v_cache.shape[-1] == 0
        write_kv(k_cache, v_cache, meta.rows, meta.slots, entry, entry[..., :0])
        cache = latents(k_cache, meta, B)
        if W <= ABSORBED_MAX_ROWS:
            out = self.absorbed(q_nope, q_pe, cache, meta.mask)
        else:
            out = self.expanded(q_nope, q_pe, cache, meta.mask)
        return all_reduce(self.o_proj(out.reshape(B, W, self.h * m.v_head_dim)), self.tp)

    def _w_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, r] and W_UV [H, v, r]: kv_b_proj's rows per head."""
        m = self.m
        w = self.kv_b_proj.weight.view(self.h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """Attention over the latent cache as one shared head: -> [B, W, H, v]."""
        m, (B, W, H, _) = self.m, q_nope.shape
        w_uk, w_uv = self._w_b()
        q_lat = torch.einsum("bwhn,hnr->bwhr", q_nope, w_uk)
        qc = torch.cat([q_lat, q_pe], dim=-1).reshape(B, W * H, m.cache_dim)     # rows (w, h)
        s = torch.matmul(qc, cache.transpose(1, 2)).view(B, W, H, -1)
        p = masked_softmax(s, mask[:, 0, :, None, :], m.softmax_scale)           # mask per w, every h
        o_lat = torch.matmul(p.view(B, W * H, -1), cache[..., :m.kv_lora_rank]).view(B, W, H, m.kv_lora_rank)
        return torch.einsum("bwhr,hvr->bwhv", o_lat, w_uv)

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """Per-head keys and values from the cache's latents, then attention: -> [B, W, H, v]."""
        m, (B, _, H, _) = self.m, q_nope.shape
        L = cache.shape[1]
        kv = self.kv_b_proj(cache[..., :m.kv_lora_rank]).view(B, L, H, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_pe = cache[:, :, None, m.kv_lora_rank:].expand(B, L, H, m.qk_rope_head_dim)
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)                      # [B, H, L, qk]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)                      # [B, H, W, qk]
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, scale=m.softmax_scale)
        return out.transpose(1, 2)
