"""A checkpoint's tensors read one at a time, when asked: a model of tens of GB then loads layer by
layer (stacking one layer's experts at a time) instead of holding the whole checkpoint in memory,
twice, while it is rearranged. DeepSeek's fp8 weights are dequantized as they are read. A
tensor-parallel rank reads its slice of each tensor only (`parallel.shard.selector`)."""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from drafttree.loader import fp8_blocks
from drafttree.parallel.shard import Select


def shard_files(path: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json names."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
    files = [path / f for f in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint shard {f} is missing")
    return files


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """Tensors by name, the 'model.' prefix dropped; each read from its shard on access. Weights
    with a `weight_scale_inv` come dequantized (fp32) and the scales are not listed. With
    `select`, each tensor is the slice it names (read as such: the rest is never read)."""

    def __init__(self, path: str | Path, select: Select | None = None) -> None:
        path = Path(path)
        self._select = select
        self._where: dict[str, tuple[Path, str]] = {}
        self._handles: dict[Path, object] = {}
        for f in shard_files(path):
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for k in fh.keys():
                        self._where[k.removeprefix("model.")] = (f, k)
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"cannot read {f}: {e}") from None
        self._scaled = {k for k in self._where if k + fp8_blocks.SCALE_SUFFIX in self._where}
        self._block = fp8_blocks.block_size(json.loads((path / "config.json").read_text())) if self._scaled else None

    def _handle(self, name: str):
        f, key = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f], key

    def _read(self, name: str, part: tuple[slice, ...] | None = None) -> torch.Tensor:
        h, key = self._handle(name)
        return h.get_tensor(key) if part is None else h.get_slice(key)[part]

    def _shape(self, name: str) -> list[int]:
        h, key = self._handle(name)
        return h.get_slice(key).get_shape()

    def _part(self, name: str) -> tuple[slice, ...] | None:
        return None if self._select is None else self._select(name, self._shape(name))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name.endswith(fp8_blocks.SCALE_SUFFIX) or name not in self._where:
            raise KeyError(name)
        part = self._part(name)
        if name in self._scaled:
            scale = name + fp8_blocks.SCALE_SUFFIX
            if part is None:
                return fp8_blocks.dequantize(self._read(name), self._read(scale), self._block)
            read, blocks, trim = fp8_blocks.covering(part, self._shape(name), self._block)
            w = fp8_blocks.dequantize(self._read(name, read), self._read(scale, blocks), self._block)
            return w[trim].contiguous()
        t = self._read(name, part)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8 tensor {name!r} has no {name + fp8_blocks.SCALE_SUFFIX!r}")
        return t

    def shapes(self) -> "Shapes":
        """The same names as meta tensors of the shapes and dtypes reading them would give."""
        return Shapes(self)

    def meta(self, name: str) -> torch.Tensor:
        if name.endswith(fp8_blocks.SCALE_SUFFIX) or name not in self._where:
            raise KeyError(name)
        h, key = self._handle(name)
        shape, part = self._shape(name), self._part(name)
        if part is not None:
            shape = [len(range(*(part[d] if d < len(part) else slice(None)).indices(n))) for d, n in enumerate(shape)]
        dtype = torch.float32 if name in self._scaled else _DTYPES.get(h.get_slice(key).get_dtype())
        return torch.empty(shape, dtype=dtype or torch.float32, device="meta")

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._where if not k.endswith(fp8_blocks.SCALE_SUFFIX))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._where and not name.endswith(fp8_blocks.SCALE_SUFFIX)


class Shapes(Mapping[str, torch.Tensor]):
    """`CheckpointTensors.shapes()`: meta tensors, so that a checkpoint is checked before it is read."""

    def __init__(self, tensors: CheckpointTensors) -> None:
        self._t = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._t.meta(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def __contains__(self, name: object) -> bool:
        return name in self._t


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}
