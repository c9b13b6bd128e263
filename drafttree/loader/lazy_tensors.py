"""A checkpoint's tensors read one at a time, when asked: a model of tens of GB then loads layer by
layer (stacking one layer's experts at a time) instead of holding the whole checkpoint in memory,
twice, while it is rearranged. A tensor-parallel rank reads its slice of each tensor only
(`parallel.shard.selector`).

A weight stored quantized (`loader.quantization`) is listed under its module's `.weight` name and
comes as a `packed.Packed`, its parts unlisted: compressed-tensors int4 (`weight_packed`,
`weight_scale`, `weight_shape`) or DeepSeek's fp8 (`weight` e4m3 and `weight_scale_inv`). Which
Linear modules are int4 is the config's to say; a checkpoint that stores one otherwise is refused,
naming the module, as soon as its name is asked for (the loader asks for every name first, reading
nothing).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from drafttree.kernels import int4_ops
from drafttree.loader import fp8_blocks
from drafttree.loader.packed import Packed, Weight, part_of
from drafttree.loader.quantization import FP8, INT4, LINEAR, Quantization
from drafttree.parallel.shard import Select

PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"   # int4: <module>.weight + each


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


class CheckpointTensors(Mapping[str, Weight]):
    """Tensors by name, the 'model.' prefix dropped; each read from its shard on access. Weights
    stored quantized come as `Packed` (`quant`, the config's quantization, says which forms to
    expect). With `select`, each tensor is the slice it names (read as such: the rest is never
    read); `world`, the tensor-parallel size, names the size in a refusal."""

    def __init__(self, path: str | Path, select: Select | None = None, quant: Quantization | None = None,
                 world: int = 1) -> None:
        path = Path(path)
        self._select, self._quant, self._world = select, quant, world
        self._where: dict[str, tuple[Path, str]] = {}
        self._handles: dict[Path, object] = {}
        for f in shard_files(path):
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for k in fh.keys():
                        self._where[k.removeprefix("model.")] = (f, k)
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"cannot read {f}: {e}") from None
        # the quantized weights under their `.weight` names, and the tensors that are their parts
        self._forms: dict[str, str] = {}
        for k in self._where:
            if k.endswith(".weight" + PACKED):
                self._forms[k.removesuffix(PACKED)] = INT4
            elif k.endswith(fp8_blocks.SCALE_SUFFIX) and k.removesuffix(fp8_blocks.SCALE_SUFFIX) in self._where:
                self._forms[k.removesuffix(fp8_blocks.SCALE_SUFFIX)] = FP8
        self._parts = {w + s for w, form in self._forms.items()
                       for s in ((PACKED, SCALE, SHAPE) if form == INT4 else (fp8_blocks.SCALE_SUFFIX,))}
        self._names = [k for k in self._where if k not in self._parts]
        self._names += [w for w, form in self._forms.items() if form == INT4]
        self._listed = set(self._names)
        self._check_forms()

    def _check_forms(self) -> None:
        """The stored forms are the config's: none without a quantization_config, one method."""
        forms = set(self._forms.values())
        if not forms:
            return
        example = next(iter(self._forms))
        if self._quant is None:
            raise ValueError(f"the checkpoint stores quantized weights ({example!r} as {forms.pop()}) but its "
                             "config.json has no quantization_config")
        other = forms - {self._quant.method}
        if other:
            w = next(k for k, f in self._forms.items() if f in other)
            raise ValueError(f"the checkpoint stores {w!r} as {other.pop()}, but its quantization_config declares "
                             f"{self._quant.describe()}")

    def _handle(self, name: str):
        f, key = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f], key

    def _read(self, name: str, part: tuple[slice, ...] | None = None) -> torch.Tensor:
        h, key = self._handle(name)
        return h.get_tensor(key) if part is None else h.get_slice(key)[part]

    def _stored_shape(self, name: str) -> list[int]:
        h, key = self._handle(name)
        return h.get_slice(key).get_shape()

    def _dtype(self, name: str) -> torch.dtype:
        h, key = self._handle(name)
        return _DTYPES.get(h.get_slice(key).get_dtype(), torch.float32)

    def _shape(self, name: str) -> list[int]:
        """The tensor's shape; a packed int4 weight's unpacked."""
        if self._forms.get(name) == INT4:
            n, k = self._stored_shape(name + PACKED)
            return [n, k * int4_ops.PACK]
        return self._stored_shape(name)

    def _part(self, name: str) -> tuple[slice, ...] | None:
        return None if self._select is None else self._select(name, self._shape(name))

    def _module(self, name: str) -> str:
        """The checkpoint's module name of a `.weight` (the config's `targets` and `ignore` name these)."""
        key = self._where[name + PACKED if self._forms.get(name) == INT4 else name][1]
        return key[:key.rindex(".weight")]

    def _group_size(self, name: str) -> int:
        """An int4 weight's group size, as stored; for a Linear module, the config's too."""
        n, k = self._shape(name)
        cols = self._stored_shape(name + SCALE)
        module = self._module(name)
        if self._stored_shape(name + PACKED)[0] != cols[0] or k % cols[1]:
            raise ValueError(f"{module!r}: weight_packed {self._stored_shape(name + PACKED)} and weight_scale {cols} "
                             "are not an int4 weight in groups")
        g = k // cols[1]
        want = self._quant.group_size(module) if module.rsplit(".", 1)[-1] in LINEAR else g
        if g != want:
            raise ValueError(f"{module!r} is stored in int4 groups of {g}; its quantization_config says {want}")
        return g

    def form(self, name: str) -> str | None:
        """How the weight `name` is stored (INT4, FP8, None: as a plain tensor), once it is known to
        agree with the config: a Linear module is int4 exactly where the config covers it."""
        form = self._forms.get(name)
        q = self._quant
        if q is not None and q.method == INT4 and name.endswith(".weight"):
            module = self._module(name)
            if module.rsplit(".", 1)[-1] in LINEAR:
                g = q.group_size(module)
                if g is not None and form != INT4:
                    raise ValueError(f"the quantization_config ({q.describe()}) covers {module!r}, but the checkpoint "
                                     f"stores {module}.weight unquantized")
                if g is None and form == INT4:
                    raise ValueError(f"the checkpoint stores {module!r} as int4 (weight_packed), but the "
                                     "quantization_config's targets and ignore leave it unquantized")
        return form

    def __getitem__(self, name: str) -> Weight:
        if name not in self._listed:
            raise KeyError(name)
        form, part = self.form(name), self._part(name)
        if form is None:
            self._check_plain(name)
            return self._read(name, part)
        if form == INT4:
            g = self._group_size(name)
            self._check_shape_tensor(name)
            data, scale, _ = (None, None, None) if part is None else self._int4_part(name, part, g)
            return Packed(INT4, self._read(name + PACKED, data), self._read(name + SCALE, scale), group_size=g)
        block = self._quant.block
        scale_name = name + fp8_blocks.SCALE_SUFFIX
        if part is None:
            return Packed(FP8, self._read(name), self._read(scale_name), block=block)
        read, scales, trim = part_of(FP8, name, part, self._shape(name), 0, block, self._world)
        w, s = self._read(name, read), self._read(scale_name, scales)
        if trim is None:
            return Packed(FP8, w, s, block=block)
        return fp8_blocks.dequantize(w, s, block)[trim].contiguous()

    def _check_plain(self, name: str) -> None:
        if self._dtype(name) in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8 tensor {name!r} has no {name + fp8_blocks.SCALE_SUFFIX!r}")

    def _int4_part(self, name: str, part: tuple[slice, ...], g: int):
        return part_of(INT4, name, part, self._shape(name), g, (0, 0), self._world)

    def _check_shape_tensor(self, name: str) -> None:
        """`weight_shape`, where stored, must be the unpacked shape (inputs a multiple of 8)."""
        if name + SHAPE in self._where:
            stored = [int(v) for v in self._read(name + SHAPE).tolist()]
            if stored != self._shape(name):
                raise ValueError(f"{self._module(name)!r}: weight_shape {stored}, but weight_packed holds "
                                 f"{self._shape(name)} (inputs must be a multiple of 8)")

    def shapes(self) -> "Shapes":
        """The same names as meta tensors (or `Packed` of meta tensors) of the shapes and dtypes
        reading them would give."""
        return Shapes(self)

    def meta(self, name: str) -> Weight:
        if name not in self._listed:
            raise KeyError(name)
        form, part, shape = self.form(name), self._part(name), self._shape(name)
        if form is None:
            self._check_plain(name)
            return _empty(shape, part, self._dtype(name))
        if form == INT4:
            g = self._group_size(name)
            data, scale, _ = (None, None, None) if part is None else self._int4_part(name, part, g)
            return Packed(INT4, _empty(self._stored_shape(name + PACKED), data, torch.int32),
                          _empty(self._stored_shape(name + SCALE), scale, self._dtype(name + SCALE)), group_size=g)
        block, scale_name = self._quant.block, name + fp8_blocks.SCALE_SUFFIX
        fp8_blocks.check_grid(name, shape, self._stored_shape(scale_name), block)
        read, scales, trim = (None, None, None) if part is None else part_of(FP8, name, part, shape, 0, block,
                                                                             self._world)
        if trim is not None:
            return _empty(shape, part, torch.float32)
        return Packed(FP8, _empty(shape, read, self._dtype(name)),
                      _empty(self._stored_shape(scale_name), scales, self._dtype(scale_name)), block=block)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._listed


def _empty(shape: list[int], part: tuple[slice, ...] | None, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of `shape`, or of its slice `part`."""
    if part is not None:
        shape = [len(range(*(part[d] if d < len(part) else slice(None)).indices(n))) for d, n in enumerate(shape)]
    return torch.empty(shape, dtype=dtype, device="meta")


class Shapes(Mapping[str, Weight]):
    """`CheckpointTensors.shapes()`: meta tensors, so that a checkpoint is checked before it is read."""

    def __init__(self, tensors: CheckpointTensors) -> None:
        self._t = tensors

    def __getitem__(self, name: str) -> Weight:
        return self._t.meta(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def __contains__(self, name: object) -> bool:
        return name in self._t


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
