"""fp8 weights with one scale per block, as DeepSeek-V3 and Kimi K2 store them (e4m3, one fp32
`weight_scale_inv` per 128 x 128 block: the multiplier that dequantizes), and the torch forms that
compute with them (the fallback beside the fp8 kernels; on the CPU the loader widens them instead).

A weight [N, K] is `w` e4m3 [N, K] and `scale_inv` fp32 [ceil(N / bn), ceil(K / bk)]; stacked experts
add a leading [E] to both (gate and up stacked along N: their blocks stack too, when I is a
multiple of bn).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from drafttree.kernels.torch_ops import silu_mul

Block = tuple[int, int]


def check_layout(w: torch.Tensor, scale_inv: torch.Tensor, block: Block) -> None:
    """Refuse a scale grid that does not cover w's blocks (shapes only: no sync)."""
    *lead, N, K = w.shape
    bn, bk = block
    want = (*lead, -(-N // bn), -(-K // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a {list(w.shape)} weight in "
                         f"{bn} x {bk} blocks; expected {want}")


def quantize(w: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], scale_inv fp32 [..., ceil(N / bn), ceil(K / bk)]): each
    block divided by its largest magnitude over e4m3's largest value (an all-zero block: scale 1)."""
    *lead, N, K = w.shape
    bn, bk = block
    rows, cols = -(-N // bn), -(-K // bk)
    padded = F.pad(w.float(), (0, cols * bk - K, 0, rows * bn - N))
    blocks = padded.view(*lead, rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(*lead, rows * bn, cols * bk)[..., :N, :K].contiguous(), scale


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: Block,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., N, K] (e4m3) times its block's scale -> [..., N, K] in `dtype` (computed in fp32)."""
    check_layout(w, scale_inv, block)
    N, K = w.shape[-2:]
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
    return (w.float() * s).to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: Block,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for the block-scaled fp8 weight W [N, K]: widened, then a matmul in x's dtype."""
    return F.linear(x, dequantize(w, scale_inv, block, x.dtype), bias)


def experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
            down: torch.Tensor, down_scale: torch.Tensor, block: Block) -> torch.Tensor:
    """Σ_k w[n, k] · expert_idx[n, k](x[n]) for x [N, D], w and idx [N, k], with fp8 experts
    gate_up [E, 2I, D], down [E, D, I] and their block scales. An id of E (another rank's expert)
    adds nothing. Each pair's expert is widened, then a batched GEMV (static shapes, no sync; a
    transient of N * k experts: the CPU and small tests)."""
    E = gate_up.shape[0]
    mine = idx < E
    e = idx.clamp(max=E - 1)
    gu = dequantize(gate_up[e], gate_up_scale[e], block, x.dtype)
    dn = dequantize(down[e], down_scale[e], block, x.dtype)
    h = torch.matmul(gu, x[:, None, :, None])[..., 0]
    y = torch.matmul(dn, silu_mul(h)[..., None])[..., 0]
    wk = torch.where(mine, w, torch.zeros_like(w)).to(y.dtype)
    return (y * wk[..., None]).sum(dim=1)
