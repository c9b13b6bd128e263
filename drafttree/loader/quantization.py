"""The quantization a checkpoint declares (config.json's `quantization_config`), read once before
any weight is: which stored forms the loader keeps as they are, and which modules they cover.

Two forms load, kept quantized on the device (`models.quant_linear`):
    int4   compressed-tensors `pack-quantized` (Kimi K2.6's routed experts): symmetric int4 in
           groups of G inputs, weights only. A Linear module is covered when a config group's
           `targets` match it (the class name "Linear", an exact module name, or "re:<regex>"
           matched from the name's start, as compressed-tensors matches) and no `ignore` entry
           does; names are the checkpoint's (`model.layers.3.mlp.experts.7.gate_proj`).
    fp8    DeepSeek-V3's e4m3 weights, one fp32 `weight_scale_inv` per `weight_block_size` block;
           activations stay 16-bit (`activation_scheme: dynamic` is their on-the-fly rounding,
           which this reading skips). Which weights are fp8 is what the checkpoint stores.
Anything else is refused with a ValueError naming the form found.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INT4, FP8 = "int4", "fp8"
SUPPORTED = ("compressed-tensors 'pack-quantized' int4 weights (symmetric, strategy 'group', no activation or "
             "KV-cache quantization), or quant_method 'fp8' with e4m3 weights in weight_block_size blocks "
             "(DeepSeek-V3's; activation_scheme 'dynamic')")

# the Linear modules of the Hugging Face models loaded here (what a "Linear" target names); the
# routers (`mlp.gate`) are read widened in whichever form they are stored
LINEAR = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                    "gate_proj", "up_proj", "down_proj", "lm_head"})


@dataclass(frozen=True)
class Int4Group:
    """One compressed-tensors config group: the modules its targets name, in groups of `group_size`."""
    name: str
    targets: tuple[str, ...]
    group_size: int


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: `method` INT4 (compressed-tensors, `groups` and `ignore`) or
    FP8 (`block` [bn, bk])."""
    method: str
    groups: tuple[Int4Group, ...] = ()
    ignore: tuple[str, ...] = ()
    block: tuple[int, int] = (128, 128)

    def group_size(self, module: str) -> int | None:
        """int4: the group size `module` (a checkpoint module name) is stored in, None where it is
        not covered (no target names it, or an ignore entry does). fp8: None (the stored form tells)."""
        if self.method != INT4 or any(matches(module, ig) for ig in self.ignore):
            return None
        sizes = {g.group_size for g in self.groups if any(matches(module, t) for t in g.targets)}
        if len(sizes) > 1:
            raise ValueError(f"quantization_config: several config groups of different group sizes {sorted(sizes)} "
                             f"cover {module!r}")
        return sizes.pop() if sizes else None

    def describe(self) -> str:
        if self.method == FP8:
            return f"fp8 e4m3 in {self.block[0]} x {self.block[1]} blocks"
        return "int4 pack-quantized in groups of " + "/".join(str(g.group_size) for g in self.groups)


def matches(module: str, target: str) -> bool:
    """compressed-tensors' rule: 're:<regex>' matches from the name's start (re.match), a class
    name ("Linear") every Linear module, anything else the exact name."""
    if target.startswith("re:"):
        return _regex(target[3:]).match(module) is not None
    if target == "Linear":
        return module.rsplit(".", 1)[-1] in LINEAR
    return module == target


_REGEXES: dict[str, re.Pattern] = {}


def _regex(pattern: str) -> re.Pattern:
    if pattern not in _REGEXES:
        try:
            _REGEXES[pattern] = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"quantization_config: bad regex 're:{pattern}': {e}") from None
    return _REGEXES[pattern]


def from_dir(path: str | Path) -> Quantization | None:
    """`parse` of a model directory's config.json."""
    f = Path(path) / "config.json"
    try:
        return parse(json.loads(f.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None


def parse(config: dict[str, Any]) -> Quantization | None:
    """The quantization of a config.json (None: unquantized); a ValueError for a form not loaded."""
    q = config.get("quantization_config") or config.get("compression_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        return _compressed(q)
    raise _refuse(f"quant_method {method!r}")


def _refuse(found: str) -> ValueError:
    return ValueError(f"unsupported checkpoint quantization: {found}; drafttree loads {SUPPORTED}")


def _fp8(q: dict[str, Any]) -> Quantization:
    fmt, acts = q.get("fmt", "e4m3"), q.get("activation_scheme", "dynamic")
    if fmt != "e4m3":
        raise _refuse(f"fp8 fmt {fmt!r}")
    if acts != "dynamic":
        raise _refuse(f"fp8 activation_scheme {acts!r} (static activation scales)")
    block = q.get("weight_block_size")
    if block is None:
        raise _refuse("fp8 without weight_block_size (one scale per tensor or channel)")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(f"fp8 weight_block_size {block!r} (two positive ints)")
    return Quantization(FP8, block=(block[0], block[1]))


def _compressed(q: dict[str, Any]) -> Quantization:
    if q.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme (a quantized KV cache)")
    for extra in ("sparsity_config", "transform_config"):
        if q.get(extra):
            raise _refuse(f"compressed-tensors {extra}")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors without config_groups")
    out = [_group(name, scheme, q.get("format")) for name, scheme in groups.items()]
    ignore = q.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(i, str) for i in ignore)):
        raise ValueError(f"quantization_config: ignore must be a list of names, got {ignore!r}")
    for t in ignore:
        if t.startswith("re:"):
            _regex(t[3:])
    return Quantization(INT4, tuple(out), tuple(ignore))


def _group(name: str, scheme: Any, top_format: str | None) -> Int4Group:
    if not isinstance(scheme, dict):
        raise _refuse(f"compressed-tensors config group {name!r} given as the preset {scheme!r}")
    fmt = scheme.get("format") or top_format
    if fmt != "pack-quantized":
        raise _refuse(f"compressed-tensors format {fmt!r} in config group {name!r}")
    for acts in ("input_activations", "output_activations"):
        if scheme.get(acts):
            a = scheme[acts]
            raise _refuse(f"compressed-tensors {acts} ({a.get('num_bits')}-bit {a.get('type')}) in config group "
                          f"{name!r}")
    w = scheme.get("weights")
    if not isinstance(w, dict):
        raise _refuse(f"compressed-tensors config group {name!r} without weights")
    bits, kind, sym = w.get("num_bits", 8), w.get("type", "int"), w.get("symmetric", True)
    size = w.get("group_size")
    strategy = w.get("strategy") or ("group" if isinstance(size, int) and size > 0 else "tensor")
    found = (f"compressed-tensors {fmt!r} {bits}-bit {kind} weights, strategy {strategy!r}"
             f"{'' if sym else ', asymmetric'} in config group {name!r}")
    if bits != 4 or kind != "int" or not sym or strategy != "group":
        raise _refuse(found)
    if not isinstance(size, int) or size <= 0 or size % 8:
        raise _refuse(f"{found} with group_size {size!r} (a positive multiple of 8)")
    if w.get("dynamic"):
        raise _refuse(f"{found}, dynamic")
    if w.get("actorder") in (True, "group", "dynamic"):
        raise _refuse(f"{found}, actorder {w['actorder']!r} (columns permuted by g_idx)")
    targets = scheme.get("targets")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"quantization_config: config group {name!r} has no targets list")
    for t in targets:
        if t.startswith("re:"):
            _regex(t[3:])
        elif t != "Linear" and "." not in t and t[:1].isupper():
            raise _refuse(f"compressed-tensors target class {t!r} in config group {name!r} (only 'Linear')")
    return Int4Group(name, tuple(targets), size)
