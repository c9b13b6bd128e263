"""Static KV cache: one row per running request, allocated once; plus the attention metadata.

Batch row b always uses cache row b (the engine keeps running requests packed in rows
0..B-1), so a forward reads `cache[:, :B]` as a view and never gathers. It sits with the
models, whose attention defines its layout, so that the rounds (spec), the runner and the
trainer all use it without importing one another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafttree.kernels.fused import fused
from drafttree.models.layers import AttnMeta


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, rows, Hkv, max_len, hd]: head-major, see models.layers.cached_attention
    v: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, rows: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None) -> "KVCache":
        """v_head_dim: V's width when it is not head_dim (0 for MLA, whose latent is all in K)."""
        shape = (layers, rows, kv_heads, max_len, head_dim)
        v_shape = shape[:-1] + (head_dim if v_head_dim is None else v_head_dim,)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(v_shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_head_dim: int | None = None) -> int:
        width = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        return layers * kv_heads * width * torch.empty((), dtype=dtype).element_size()

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For rows 0..B-1, move entries src[b, i] -> dst[b, i] in every layer ([B, T] each).
        All sources are read before any destination is written, so overlaps are safe."""
        B = src.shape[0]
        rows = torch.arange(B, device=src.device)[:, None]
        for t in (self.k, self.v):
            moved = t[:, rows, :, src]         # [B, T, layers, Hkv, hd]
            t[:, rows, :, dst] = moved

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def attn_meta(start: torch.Tensor, intra: torch.Tensor, kv_len: int,
              slots: torch.Tensor | None = None) -> AttnMeta:
    """Queries of row b occupy cache slots start[b] .. start[b]+W-1 (unless `slots` says otherwise).

    A query sees every committed entry (< start[b]) and, among the W new entries, those that
    intra[b, i, k] allows: causal (prefill, chain verify), all (draft block), ancestors (tree).
    """
    mask, own_slots, rows = _visibility(start, intra, kv_len)
    return AttnMeta(slots=own_slots if slots is None else slots, mask=mask, rows=rows)


@fused
def _visibility(start: torch.Tensor, intra: torch.Tensor,
                kv_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attn_meta`'s mask [B, 1, W, L], default slots [B, W] and rows [B, 1] (on CUDA in one or
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
