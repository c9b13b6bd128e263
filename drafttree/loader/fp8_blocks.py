"""DeepSeek-V3's fp8 checkpoints: e4m3 weights with one fp32 scale per 128 x 128 block
(`<name>.weight_scale_inv`, the multiplier that dequantizes; `quantization_config.weight_block_size`
gives the block). The loader keeps them so on the device (`models.quant_linear.Fp8BlockLinear`,
`models.quant_experts.Fp8BlockExperts`); a slice whose edges miss the blocks, and a weight the model
uses as a matrix (MLA's kv_b_proj), are read by the blocks that cover them and dequantized here.
"""
from __future__ import annotations

import torch

from drafttree.kernels import fp8_block_ops

SCALE_SUFFIX = "_scale_inv"


def check_grid(name: str, shape: list[int], scale_shape: list[int], block: tuple[int, int]) -> None:
    """Refuse a `weight_scale_inv` whose grid is not the blocks of its [N, K] weight (shapes only)."""
    want = [-(-n // b) for n, b in zip(shape, block)]
    if list(scale_shape) != want or len(shape) != 2:
        raise ValueError(f"{name}_scale_inv of shape {list(scale_shape)} for a {list(shape)} weight in "
                         f"{block[0]} x {block[1]} blocks; expected {want}")


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
