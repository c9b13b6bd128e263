"""DeepSeek-V3's fp8 checkpoints: e4m3 weights with one fp32 scale per 128 x 128 block
(`<name>.weight_scale_inv`, the multiplier that dequantizes). They are dequantized at load, to the
model's dtype: the weights then take the memory of bf16 (fp8 matmuls on the blocks come later)."""
from __future__ import annotations

from typing import Any

import torch

from drafttree.kernels import fp8_block_ops

SCALE_SUFFIX = "_scale_inv"


def block_size(config: dict[str, Any]) -> tuple[int, int]:
    """The quantization_config's weight_block_size ([128, 128] unless it says otherwise)."""
    q = config.get("quantization_config") or {}
    if q and q.get("quant_method", "fp8") != "fp8":
        raise ValueError(f"unsupported quantization {q.get('quant_method')!r} (supported: fp8 block-scaled)")
    bn, bk = q.get("weight_block_size") or (128, 128)
    return int(bn), int(bk)


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [N, K] (e4m3) times its block's scale, scale_inv [ceil(N / bn), ceil(K / bk)] -> fp32 [N, K]."""
    return fp8_block_ops.dequantize(w, scale_inv, block)


def covering(part: tuple[slice, ...], shape: list[int],
             block: tuple[int, int]) -> tuple[tuple[slice, ...], tuple[slice, ...], tuple[slice, ...]]:
    """For `part` of a [N, K] weight (a tensor-parallel shard's rows or columns, step 1): the
    block-aligned slice of the weight to read, the scales of the blocks it covers, and where `part`
    lies in the read once dequantized. A shard's edge need not fall on a block's (a 2048-row
    expert's shard of 1024 rows at 128 x 128 blocks does; a q_b_proj head's 192 rows do not)."""
    read, scales, trim = [], [], []
    for d, n in enumerate(shape):
        a, b, _ = (part[d] if d < len(part) else slice(None)).indices(n)
        bs = block[d]
        lo, hi = a // bs, -(-b // bs)
        read.append(slice(lo * bs, min(hi * bs, n)))
        scales.append(slice(lo, hi))
        trim.append(slice(a - lo * bs, b - lo * bs))
    return tuple(read), tuple(scales), tuple(trim)
