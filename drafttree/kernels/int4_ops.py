"""int4 weights as compressed-tensors stores them (`pack-quantized`, symmetric, group strategy), and
the torch forms that compute with them (the fallback beside the W4A16 kernels).

Layout, as stored and as kept on the device: a weight [N, K] is `packed` int32 [N, K / 8], word j
of a row holding inputs 8j .. 8j + 7, input 8j + i in bits 4i .. 4i + 3 as q + 8 (q in [-8, 7]);
`scale` [N, K / G] (the checkpoint's dtype, bf16 for Kimi K2.6) holds one scale per G inputs of a
row, G the group size (32 for Kimi K2.6). The weight is q * scale. Stacked experts add a leading
[E] to both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from drafttree.kernels.torch_ops import silu_mul

PACK = 8          # int4 values per int32 word
OFFSET = 8        # stored nibble = q + 8
QMAX = 7


def check_layout(packed: torch.Tensor, scale: torch.Tensor, group_size: int, in_features: int) -> None:
    """Refuse tensors that are not a packed int4 weight of `in_features` inputs in groups of
    `group_size` (shapes only: no sync)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"int4 weights are packed in int32 words, got {packed.dtype}")
    if in_features % PACK or in_features % group_size:
        raise ValueError(f"{in_features} inputs: int4 needs a multiple of {PACK} and of the group size {group_size}")
    if packed.shape[-1] * PACK != in_features or scale.shape[-1] * group_size != in_features:
        raise ValueError(f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} are not a weight of "
                         f"{in_features} inputs in groups of {group_size}")
    if packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} disagree on their rows")


def pack(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] [..., K] (K a multiple of 8) -> int32 words [..., K / 8]."""
    *lead, K = q.shape
    u = (q.to(torch.int32) + OFFSET).view(*lead, K // PACK, PACK)
    shifts = torch.arange(PACK, device=q.device, dtype=torch.int32) * 4
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., K / 8] -> int8 values in [-8, 7] [..., K]."""
    shifts = torch.arange(PACK, device=packed.device, dtype=torch.int32) * 4
    u = (packed[..., None] >> shifts) & 0xF
    return (u - OFFSET).to(torch.int8).flatten(-2)


def quantize(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantization of w [..., K]: (packed int32 [..., K / 8], scale [..., K / G]),
    each group's absmax mapped to 7 (random weights and tests; a checkpoint brings its own)."""
    *lead, K = w.shape
    g = w.float().reshape(*lead, K // group_size, group_size)
    scale = (g.abs().amax(dim=-1) / QMAX).clamp(min=1e-8).to(scale_dtype)
    q = torch.round(g / scale.float()[..., None]).clamp(-OFFSET, QMAX).reshape(*lead, K)
    return pack(q), scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight q * scale [..., K] in `dtype` (computed in fp32)."""
    q = unpack(packed).float()
    *lead, K = q.shape
    w = q.view(*lead, K // group_size, group_size) * scale.float()[..., None]
    return w.view(*lead, K).to(dtype)


def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for the int4 weight W [N, K]: the weight unpacked, then a matmul in x's dtype."""
    return F.linear(x, dequantize(packed, scale, group_size, x.dtype), bias)


def experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
            down: torch.Tensor, down_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Σ_k w[n, k] · expert_idx[n, k](x[n]) for x [N, D], w and idx [N, k], with int4 experts:
    gate_up [E, 2I, D / 8] (scales [E, 2I, D / G]), down [E, D, I / 8] (scales [E, D, I / G]).
    An id of E (a pair routed to another rank's expert) adds nothing. Each pair's expert is
    unpacked, then a batched GEMV: static shapes, no host sync (graph-capturable); its transient
    holds N * k unpacked experts, so it serves the CPU and small tests, not a GPU's prefill."""
    E = gate_up.shape[0]
    mine = idx < E
    e = idx.clamp(max=E - 1)
    gu = dequantize(gate_up[e], gate_up_scale[e], group_size, x.dtype)                 # [N, k, 2I, D]
    dn = dequantize(down[e], down_scale[e], group_size, x.dtype)                       # [N, k, D, I]
    h = torch.matmul(gu, x[:, None, :, None])[..., 0]
    y = torch.matmul(dn, silu_mul(h)[..., None])[..., 0]                               # [N, k, D]
    wk = torch.where(mine, w, torch.zeros_like(w)).to(y.dtype)
    return (y * wk[..., None]).sum(dim=1)


# Unpacked expert weights `experts_all` holds at a time (2^27 values: 256 MiB in bf16, about six
# times that in the unpacking's transients).
ALL_EXPERTS_VALUES = 1 << 27


def experts_all(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """`experts` as every expert over every row, scaled by its combine weight (zero where it was
    not picked, and for id E): each expert unpacked once, in groups holding at most
    ALL_EXPERTS_VALUES values, where `experts` unpacks one per pair. E / k times the FLOPs of the
    picked experts: the torch form for many rows (a GPU's verify or prefill chunk). Static shapes,
    no host sync."""
    E, two_i, _ = gate_up.shape
    N, D = x.shape
    combine = torch.zeros(N, E + 1, dtype=x.dtype, device=x.device)   # column E: other ranks' pairs
    combine = combine.scatter_add_(1, idx, w.to(x.dtype))[:, :E]
    out = torch.zeros_like(x)
    step = max(1, ALL_EXPERTS_VALUES // (3 * (two_i // 2) * D))
    for a in range(0, E, step):
        gu = dequantize(gate_up[a:a + step], gate_up_scale[a:a + step], group_size, x.dtype)   # [e, 2I, D]
        dn = dequantize(down[a:a + step], down_scale[a:a + step], group_size, x.dtype)         # [e, D, I]
        h = torch.matmul(x, gu.transpose(1, 2))                                                 # [e, N, 2I]
        y = torch.matmul(silu_mul(h), dn.transpose(1, 2))                                       # [e, N, D]
        out += torch.bmm(y.permute(1, 2, 0), combine[:, a:a + step, None])[..., 0]
    return out
