"""Routed experts kept as the checkpoint stores them: int4 packed (Kimi K2.6's, compressed-tensors
`pack-quantized`) or e4m3 in scaled blocks (DeepSeek-V3's fp8), stacked per expert as
`moe.Experts` stacks them: `gate_up` [E, 2I, ...] = gate's rows then up's, `down` [E, D, ...],
each with its scales (`gate_up_scale`, `down_scale`).

    int4  gate_up int32 [E, 2I, D / 8], scale [E, 2I, D / G]; down int32 [E, D, I / 8], scale [E, D, I / G]
    fp8   gate_up e4m3 [E, 2I, D], scale fp32 [E, 2I / bn, ceil(D / bk)]; down e4m3 [E, D, I],
          scale [E, ceil(D / bn), ceil(I / bk)]   (I a multiple of bn, so that gate's blocks end where up's begin)

They route and choose their form as `moe.Experts` (over tensor parallelism a rank's own E/N
experts, the others' pairs at id E weighing zero). Where the grouped kernels run, and for the few
pairs of a decode, the dispatch entry runs (`dispatch.int4_experts` / `fp8_block_experts`: the
kernels, or each pair's expert widened and a batched GEMV); otherwise the torch forms run over
experts widened as they are used: every expert over every row in groups (at most
ALL_EXPERTS_ELEMENTS widened values at a time), or, for an eager prefill, each expert over its own
rows through the linear entries. All but the last are static and sync-free: graphs capture them.
"""
from __future__ import annotations

import torch
from torch import nn

from drafttree.kernels import dispatch, fp8_block_ops, int4_ops
from drafttree.kernels.torch_ops import silu_mul
from drafttree.models import moe
from drafttree.models.quant_linear import FP8, PACK, check_int4
from drafttree.moe_config import MoEConfig
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import expert_span


class StoredExperts(moe.Experts):
    """`moe.Experts` over stored weights; the subclasses give the layout."""

    STORED = ("gate_up", "gate_up_scale", "down", "down_scale")
    METHOD = ""

    def __init__(self, hidden: int, cfg: MoEConfig, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)   # not Experts': its 16-bit weights are never built
        world, rank = (tp.world, tp.rank) if tp is not None else (1, 0)
        self.first, E = expert_span(cfg.num_experts, world, rank)
        self.sharded = E < cfg.num_experts
        self.hidden, self.inter = hidden, I = hidden, cfg.intermediate_size
        for name, (n, k) in (("gate_up", (2 * I, hidden)), ("down", (hidden, I))):
            (shape, dtype), (scale_shape, scale_dtype) = self.layout(n, k)
            self.register_buffer(name, torch.empty(E, *shape, dtype=dtype))
            self.register_buffer(name + "_scale", torch.empty(E, *scale_shape, dtype=scale_dtype))

    def layout(self, n: int, k: int) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
        """((shape, dtype) of one expert's stored [n, k] weight, (shape, dtype) of its scales)."""
        raise NotImplementedError

    def layout_key(self) -> tuple:
        """(method, group size, block, scale dtype), as `loader.packed.Packed.layout`."""
        return (self.METHOD, getattr(self, "group_size", 0), tuple(getattr(self, "block", (0, 0))),
                self.gate_up_scale.dtype)

    def grouped(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.stored(x, w, idx)

    def gathered(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.stored(x, w, idx)

    def stored(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The dispatch entry over every pair (ids E: another rank's, skipped)."""
        raise NotImplementedError

    def widen(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored weights [..., n, *] and their scales -> [..., n, k] in `dtype`."""
        raise NotImplementedError

    def group(self, rows: int) -> int:
        """As `moe.Experts.group`, the widened weights of a group also within ALL_EXPERTS_ELEMENTS."""
        n = moe.ALL_EXPERTS_ELEMENTS
        return max(1, min(n // (rows * max(2 * self.inter, self.hidden)), n // (3 * self.inter * self.hidden)))

    def weights(self, a: int, b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.widen(self.gate_up[a:b], self.gate_up_scale[a:b], dtype),
                self.widen(self.down[a:b], self.down_scale[a:b], dtype))


class Int4Experts(StoredExperts):
    """int4 experts in groups of `group_size` inputs (32 for Kimi K2.6)."""

    METHOD = "int4"

    def __init__(self, hidden: int, cfg: MoEConfig, tp: TPGroup | None = None, group_size: int = 32,
                 scale_dtype: torch.dtype = torch.bfloat16) -> None:
        check_int4(hidden, group_size)
        check_int4(cfg.intermediate_size, group_size)
        self.group_size, self.scale_dtype = group_size, scale_dtype
        super().__init__(hidden, cfg, tp)

    def layout(self, n: int, k: int):
        return ((n, k // PACK), torch.int32), ((n, k // self.group_size), self.scale_dtype)

    def widen(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return int4_ops.dequantize(data, scale, self.group_size, dtype)

    def stored(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return dispatch.int4_experts(x, w, idx, self.gate_up, self.gate_up_scale, self.down, self.down_scale,
                                     self.group_size, dropless=not self.sharded)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        G = self.group_size
        h = dispatch.int4_linear(x, self.gate_up[e], self.gate_up_scale[e], G)
        return dispatch.int4_linear(silu_mul(h), self.down[e], self.down_scale[e], G)

    def extra_repr(self) -> str:
        return f"experts={self.gate_up.shape[0]}, int4 in groups of {self.group_size}"


class Fp8BlockExperts(StoredExperts):
    """e4m3 experts with one scale per `block` [bn, bk] (128 x 128 for DeepSeek-V3)."""

    METHOD = "fp8"

    def __init__(self, hidden: int, cfg: MoEConfig, tp: TPGroup | None = None, block: tuple[int, int] = (128, 128),
                 scale_dtype: torch.dtype = torch.float32) -> None:
        if cfg.intermediate_size % block[0]:
            raise ValueError(f"fp8 experts of {cfg.intermediate_size} intermediate rows in blocks of {block[0]} rows: "
                             "gate's last block would run into up's")
        self.block, self.scale_dtype = tuple(block), scale_dtype
        super().__init__(hidden, cfg, tp)

    def layout(self, n: int, k: int):
        bn, bk = self.block
        return ((n, k), FP8), ((-(-n // bn), -(-k // bk)), self.scale_dtype)

    def widen(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8_block_ops.dequantize(data, scale, self.block, dtype)

    def stored(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_block_experts(x, w, idx, self.gate_up, self.gate_up_scale, self.down, self.down_scale,
                                          self.block, dropless=not self.sharded)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = dispatch.fp8_block_linear(x, self.gate_up[e], self.gate_up_scale[e], self.block)
        return dispatch.fp8_block_linear(silu_mul(h), self.down[e], self.down_scale[e], self.block)

    def extra_repr(self) -> str:
        return f"experts={self.gate_up.shape[0]}, fp8 in {self.block[0]} x {self.block[1]} blocks"
