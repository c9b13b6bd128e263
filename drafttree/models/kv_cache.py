"""The KV caches and the attention metadata.

`PagedKVCache`: the serving cache. Every layer's K (and V) is one pool of slots, head-major,
`[layers, 1, Hkv, num_pages * page_size, hd]`: page p holds slots p * page_size .. + page_size - 1.
A request's logical position j lives in slot `block_table[j // page_size] * page_size + j %
page_size` (`page_slots`). Head-major, because rows and heads then fold into one batch stride for
the attention's matmuls (a token-major cache made `torch.matmul` copy it at every batch above 1:
QKᵀ 232 against 23 µs at batch 16, L = 2,048); one pool "row", because the KV-write kernels
address `cache[row, :, slot]` and take row 0 and the slot mapping unchanged. Page 0 is the null
page: never allocated, every unused block-table entry points at it, so writes that land nowhere
(parked rows, a padded prefill's tail) land there, where no query looks.

`KVCache`: one contiguous row per request, `[layers, rows, Hkv, max_len, hd]`; the trainer's
feature extractor uses it (batch row b is cache row b, no block table).

Both sit with the models, whose attention defines their layout, so that the rounds (spec), the
runner and the trainer use them without importing one another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafttree.config import ModelConfig
from drafttree.kernels.fused import fused
from drafttree.models.layers import AttnMeta
from drafttree.parallel.shard import kv_heads_per_rank

NULL_PAGE = 0


@dataclass(frozen=True)
class KVLayout:
    """What one model keeps per token: in each layer, kv_heads heads of k_dim in K and of v_dim in
    V. The pools' shapes and the pool's sizing (`bytes_per_token`) both follow from it. MLA keeps
    its latent as one K head of kv_lora_rank + qk_rope_head_dim and no V (v_dim 0: a V pool of no
    bytes, which writes and compaction pass over)."""
    layers: int
    kv_heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig, world: int = 1, rank: int = 0) -> "KVLayout":
        """`cfg`'s layout; over `world` tensor-parallel ranks, rank `rank`'s (its share of the KV
        heads). MLA's latent head is every query head's keys and values, so each rank keeps it whole."""
        heads = 1 if cfg.mla is not None else kv_heads_per_rank(cfg.num_kv_heads, world, rank)
        return cls(cfg.num_layers, heads, cfg.head_dim, cfg.v_cache_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.layers * self.kv_heads * (self.k_dim + self.v_dim) * torch.empty((), dtype=dtype).element_size()

    def zeros(self, rows: int, slots: int, dtype: torch.dtype,
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, [layers, rows, kv_heads, slots, k_dim / v_dim]."""
        shape = (self.layers, rows, self.kv_heads, slots)
        return (torch.zeros(shape + (self.k_dim,), dtype=dtype, device=device),
                torch.zeros(shape + (self.v_dim,), dtype=dtype, device=device))


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, rows, Hkv, max_len, hd]: head-major, see models.layers.cached_attention
    v: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, rows: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None) -> "KVCache":
        """v_head_dim: V's width when it is not head_dim (0 for MLA, whose latent is all in K)."""
        layout = KVLayout(layers, kv_heads, head_dim, head_dim if v_head_dim is None else v_head_dim)
        return cls(*layout.zeros(rows, max_len, dtype, device))

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


@dataclass
class PagedKVCache:
    k: torch.Tensor  # [layers, 1, Hkv, num_pages * page_size, hd]
    v: torch.Tensor
    page_size: int

    @classmethod
    def allocate(cls, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> "PagedKVCache":
        if num_pages < 2:
            raise ValueError(f"a paged cache needs the null page and at least one more, got {num_pages} pages")
        return cls(*layout.zeros(1, num_pages * page_size, dtype, device), page_size)

    @property
    def num_pages(self) -> int:
        return self.k.shape[3] // self.page_size

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move slot src[b, i] -> slot dst[b, i] in every layer ([B, T] physical slots): only
        the accepted path's entries move, within the request's own pages. All sources are read
        before any destination is written, so overlaps are safe."""
        for t in (self.k, self.v):
            if t.numel() == 0:
                continue   # MLA's V: no width
            moved = t[:, 0, :, src]          # [layers, Hkv, B, T, hd]
            t[:, 0, :, dst] = moved


@fused
def page_slots(block_table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of logical positions pos [B, W] through block_table [B, P]: the slot mapping.
    A position past the table (a padded prefill's tail) maps into the null page."""
    P = block_table.shape[1]
    idx = pos // page_size
    page = block_table.gather(1, idx.clamp(0, P - 1))
    page = torch.where((idx >= 0) & (idx < P), page, NULL_PAGE)
    return page * page_size + pos % page_size


def attn_meta(start: torch.Tensor, intra: torch.Tensor, kv_len: int, slots: torch.Tensor | None = None,
              block_table: torch.Tensor | None = None, page_size: int = 0) -> AttnMeta:
    """Queries of row b occupy logical positions start[b] .. start[b]+W-1 (unless `slots` names
    other positions, [B, W']).

    A query sees every committed entry (< start[b]) and, among the W new entries, those that
    intra[b, i, k] allows: causal (prefill, chain verify), all (draft block), ancestors (tree).
    With a block table ([B, P], paged cache) the positions become pool slots and attention
    gathers positions 0..kv_len-1 through it; without, batch row b is cache row b.
    """
    mask, own, rows = _visibility(start, intra, kv_len)
    pos = own if slots is None else slots
    if block_table is None:
        return AttnMeta(slots=pos, mask=mask, rows=rows)
    assert block_table.shape[1] * page_size >= kv_len, \
        f"block table of {block_table.shape[1]} pages x {page_size} < kv length {kv_len}"
    read = torch.arange(kv_len, device=start.device).expand(start.shape[0], kv_len)
    return AttnMeta(slots=page_slots(block_table, pos, page_size), mask=mask, rows=torch.zeros_like(rows),
                    kv_slots=page_slots(block_table, read, page_size), positions=pos)


@fused
def _visibility(start: torch.Tensor, intra: torch.Tensor,
                kv_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attn_meta`'s mask [B, 1, W, L], default positions [B, W] and rows [B, 1] (on CUDA in one or
    two kernels, not nine)."""
    B, W, _ = intra.shape
    dev = intra.device
    j = torch.arange(kv_len, device=dev)
    rel = j[None, :] - start[:, None]                               # [B, L]
    in_new = (rel >= 0) & (rel < W)
    part = torch.gather(intra, 2, rel.clamp(0, W - 1)[:, None, :].expand(B, W, kv_len))
    mask = (rel < 0)[:, None, :] | (in_new[:, None, :] & part)
    return mask[:, None], start[:, None] + torch.arange(W, device=dev), torch.arange(B, device=dev)[:, None]


def causal(B: int, W: int, device: torch.device | str) -> torch.Tensor:
    return torch.ones(W, W, dtype=torch.bool, device=device).tril().expand(B, W, W)
