"""Projections whose weights stay as the checkpoint stores them on the device: int4 packed as
compressed-tensors' `pack-quantized` (Kimi K2.6), or e4m3 with one scale per block (DeepSeek-V3's
fp8). They replace nn.Linear where the loader finds a weight stored so (`loader.stored`); their
forward is the dispatch entry's (W4A16 / fp8 kernels where they run, else the torch forms:
widened, then a matmul in the activations' dtype, fp32 on the CPU included).

Their buffers named in STORED keep the stored dtypes whatever the model's dtype (int32 words,
e4m3, the checkpoint's scale dtype); a bias takes the model's.
"""
from __future__ import annotations

import torch
from torch import nn

from drafttree.kernels import dispatch
from drafttree.kernels.int4_ops import PACK

FP8 = torch.float8_e4m3fn


def check_int4(in_features: int, group_size: int) -> None:
    if group_size <= 0 or group_size % PACK or in_features % group_size:
        raise ValueError(f"int4 weights of {in_features} inputs in groups of {group_size}: the group size must be a "
                         f"multiple of {PACK} that divides the inputs")


class Int4Linear(nn.Module):
    """x @ W.T (+ bias) for W [out, in] kept packed: `weight_packed` int32 [out, in / 8] (8 values
    a word, q + 8 in 4 bits each, input order), `weight_scale` [out, in / group_size]."""

    STORED = ("weight_packed", "weight_scale")

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False,
                 scale_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        check_int4(in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // PACK, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // group_size, dtype=scale_dtype))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.int4_linear(x, self.weight_packed, self.weight_scale, self.group_size, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Fp8BlockLinear(nn.Module):
    """x @ W.T (+ bias) for W [out, in] kept as e4m3 `weight` with `weight_scale_inv`
    [ceil(out / bn), ceil(in / bk)], the multiplier of each block."""

    STORED = ("weight", "weight_scale_inv")

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool = False,
                 scale_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        bn, bk = block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale_inv", torch.empty(-(-out_features // bn), -(-in_features // bk),
                                                             dtype=scale_dtype))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


def stored_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """The buffers of `module` (names relative to it) that keep their stored dtype, and that dtype."""
    return {f"{path}.{b}" if path else b: getattr(m, b).dtype for path, m in module.named_modules()
            for b in getattr(m, "STORED", ())}
