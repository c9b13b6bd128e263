"""A weight as the checkpoint stores it (int4 packed, or fp8 in scaled blocks), carried through
the loader's fusing and stacking so that it reaches the device as stored.

`cat_rows` (q/k/v, gate/up) and `stack` (experts) keep the stored form where the parts share one
(int4 of one group size; fp8 of one block whose rows end on block edges, but for the last part),
and otherwise widen every part to fp32 (`dense`): the module then holds a 16- or 32-bit weight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from drafttree.kernels import fp8_block_ops, int4_ops
from drafttree.loader import fp8_blocks
from drafttree.loader.quantization import FP8, INT4

@dataclass
class Packed:
    """int4: `data` int32 [..., N, K / 8], `scale` [..., N, K / group_size]; fp8: `data` e4m3
    [..., N, K], `scale` fp32 [..., ceil(N / bn), ceil(K / bk)] (`block`). Meta tensors in the
    loader's check pass."""
    method: str
    data: torch.Tensor
    scale: torch.Tensor
    group_size: int = 0
    block: tuple[int, int] = (0, 0)

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, unpacked."""
        *lead, n, k = self.data.shape
        return (*lead, n, k * int4_ops.PACK if self.method == INT4 else k)

    @property
    def layout(self) -> tuple:
        return self.method, self.group_size, self.block, self.scale.dtype

    def widen(self) -> torch.Tensor:
        """The weight in fp32."""
        if self.data.is_meta:
            return torch.empty(self.shape, dtype=torch.float32, device="meta")
        if self.method == INT4:
            return int4_ops.dequantize(self.data, self.scale, self.group_size)
        return fp8_block_ops.dequantize(self.data, self.scale, self.block)

    def rows_end_on_blocks(self) -> bool:
        return self.method == INT4 or self.data.shape[-2] % self.block[0] == 0


Weight = torch.Tensor | Packed


def dense(w: Weight) -> torch.Tensor:
    """A weight as a tensor: fp32 if it came packed."""
    return w.widen() if isinstance(w, Packed) else w


def cat_rows(parts: list[Weight]) -> Weight:
    """The parts' rows one after the other (q/k/v into qkv_proj, gate/up into gate_up)."""
    first = parts[0]
    if all(isinstance(p, Packed) and p.layout == first.layout for p in parts) and \
            all(p.rows_end_on_blocks() for p in parts[:-1]):
        return replace(first, data=torch.cat([p.data for p in parts], dim=-2),
                       scale=torch.cat([p.scale for p in parts], dim=-2))
    return torch.cat(_alike(parts), dim=-2)


def stack(parts: list[Weight]) -> Weight:
    """The experts' weights stacked [E, ...]."""
    first = parts[0]
    if all(isinstance(p, Packed) and p.layout == first.layout for p in parts):
        return replace(first, data=torch.stack([p.data for p in parts]), scale=torch.stack([p.scale for p in parts]))
    return torch.stack(_alike(parts))


def same_form(a: Weight, b: Weight) -> tuple[Weight, Weight]:
    """Both as stored if both are packed alike, else both widened (an expert stack's two halves)."""
    if isinstance(a, Packed) and isinstance(b, Packed) and a.layout == b.layout:
        return a, b
    return tuple(_alike([a, b]))


def _alike(parts: list[Weight]) -> list[torch.Tensor]:
    """Tensors of one dtype: fp32 where any part came packed."""
    if not any(isinstance(p, Packed) for p in parts):
        return parts
    return [dense(p).float() for p in parts]


Slices = tuple[slice, ...]


def part_of(method: str, name: str, part: Slices, shape: list[int], group_size: int, block: tuple[int, int],
            world: int) -> tuple[Slices, Slices, Slices | None]:
    """For `part` of a stored [N, K] weight (a tensor-parallel rank's rows or inputs): the slice of
    the stored data to read, the slice of its scales, and None where that is the part as stored,
    else where the part lies in the read once widened.

    int4: a slice of rows cuts packed and scale rows alike; a slice of inputs must start and end
    on a group (a multiple of the group size and of 8), else the rank is refused (ValueError
    naming the tensor and the size). fp8: a slice whose edges fall on blocks is read as stored;
    one that does not (a 192-row head of 128-row blocks) is read by the blocks covering it, to be
    widened and trimmed (`fp8_blocks.covering`)."""
    if method == FP8:
        read, scales, trim = fp8_blocks.covering(part, shape, block)
        whole = all(t.start == 0 and t.stop == r.stop - r.start for t, r in zip(trim, read))
        return read, scales, None if whole else trim
    (rows, cols) = (tuple(part) + (slice(None),) * 2)[:2]
    n, k = shape
    a, b, _ = cols.indices(k)
    if (a, b) != (0, k):
        on_group = lambda i: i % group_size == 0 and i % int4_ops.PACK == 0  # noqa: E731
        if not (on_group(a) and (b == k or on_group(b))):
            raise ValueError(f"tensor {name!r}: tensor_parallel_size {world} gives a rank its inputs {a}:{b} of {k}, "
                             f"which do not fall on its int4 groups of {group_size}; choose a size that cuts on "
                             f"a group")
    data = (rows, slice(a // int4_ops.PACK, -(-b // int4_ops.PACK)))
    scale = (rows, slice(a // group_size, -(-b // group_size)))
    return data, scale, None
