"""The modules of a layer that take a weight as the checkpoint stores it: each projection whose
weight comes `Packed` becomes an `Int4Linear` / `Fp8BlockLinear`, routed experts that come packed
`Int4Experts` / `Fp8BlockExperts` (`models.quant_linear`, `models.quant_experts`), and the state
is renamed to their buffers. The loader's check pass builds them on the meta device from the
checkpoint's shapes; its load pass finds them built and fills them."""
from __future__ import annotations

import torch
from torch import nn

from drafttree.loader.packed import Packed, Weight
from drafttree.loader.quantization import INT4
from drafttree.models.quant_experts import Fp8BlockExperts, Int4Experts, StoredExperts
from drafttree.models.quant_linear import Fp8BlockLinear, Int4Linear

Holder = Int4Linear | Fp8BlockLinear


def install(layer: nn.Module, state: dict[str, Weight]) -> dict[str, torch.Tensor]:
    """Put holders in `layer` for the packed entries of `state` (names relative to the layer) and
    return the state under the names its modules then have."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not isinstance(w, Packed):
            out.setdefault(name, w)
        elif name.endswith(".weight"):
            path = name.removesuffix(".weight")
            holder = _linear(name, layer.get_submodule(path), w)
            _replace(layer, path, holder)
            out.update(_named(path, w, holder.STORED))
        elif name.endswith("experts.gate_up"):
            path = name.removesuffix(".gate_up")
            down = state[path + ".down"]
            _replace(layer, path, _experts(path, layer.get_submodule(path.rsplit(".", 1)[0]), w, down))
            out.update({path + ".gate_up": w.data, path + ".gate_up_scale": w.scale,
                        path + ".down": down.data, path + ".down_scale": down.scale})
        elif not name.endswith("experts.down"):
            raise ValueError(f"tensor {name!r} comes quantized where the model takes no quantized weight")
    return out


def _named(path: str, w: Packed, stored: tuple[str, str]) -> dict[str, torch.Tensor]:
    return {f"{path}.{stored[0]}": w.data, f"{path}.{stored[1]}": w.scale}


def _linear(name: str, module: nn.Module, w: Packed) -> Holder:
    """The holder for `w` in place of `module` (itself, where the load pass finds it built)."""
    n, k = w.shape
    if isinstance(module, nn.Linear):
        have, bias = (module.out_features, module.in_features), module.bias is not None
    elif isinstance(module, (Int4Linear, Fp8BlockLinear)):
        have, bias = (module.out_features, module.in_features), module.bias is not None
    else:
        raise ValueError(f"tensor {name!r} comes quantized where the model keeps a {type(module).__name__}")
    if (n, k) != have:
        raise ValueError(f"tensor {name!r} has shape {(n, k)}, the config implies {have}")
    cls = Int4Linear if w.method == INT4 else Fp8BlockLinear
    if type(module) is cls and _same_layout(module, w):
        return module
    with torch.device("meta"):
        if w.method == INT4:
            return Int4Linear(k, n, w.group_size, bias, w.scale.dtype)
        return Fp8BlockLinear(k, n, w.block, bias, w.scale.dtype)


def _same_layout(module: Holder, w: Packed) -> bool:
    scale = module.weight_scale if isinstance(module, Int4Linear) else module.weight_scale_inv
    return scale.dtype == w.scale.dtype and getattr(module, "group_size", 0) == w.group_size and \
        tuple(getattr(module, "block", (0, 0))) == w.block


def _experts(path: str, block: nn.Module, gate_up: Packed, down: Packed) -> StoredExperts:
    """Stored experts in place of the block's `experts` (themselves, where the load pass finds them built)."""
    old = block.get_submodule("experts")
    if isinstance(old, StoredExperts):
        E, D, I = old.gate_up.shape[0], old.hidden, old.inter
    else:
        E, D, I = old.gate_up.shape[0], old.gate_up.shape[2], old.down.shape[2]
    want = ((E, 2 * I, D), (E, D, I))
    if (tuple(gate_up.shape), tuple(down.shape)) != want:
        raise ValueError(f"{path}: experts stored {tuple(gate_up.shape)} and {tuple(down.shape)}, the config "
                         f"implies {want[0]} and {want[1]}")
    cls = Int4Experts if gate_up.method == INT4 else Fp8BlockExperts
    if type(old) is cls and old.layout_key() == gate_up.layout:
        return old
    layout = dict(group_size=gate_up.group_size) if gate_up.method == INT4 else dict(block=gate_up.block)
    with torch.device("meta"):
        return cls(D, block.router.moe, block.tp, scale_dtype=gate_up.scale.dtype, **layout)


def _replace(layer: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, leaf, module)
