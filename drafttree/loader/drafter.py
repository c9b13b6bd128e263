"""Load a DFlash or DFlash2 drafter checkpoint (the published formats, unchanged) for a loaded target."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from drafttree.loader.weights import layer_state_dict, load_into, read_safetensors
from drafttree.models.dflash import DFlashDrafter
from drafttree.models.dflash2 import DFlash2Config, DFlash2Drafter, drafter_config
from drafttree.models.layers import Rotary

CONVS = ("attention_conv", "mlp_conv")
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def load_drafter(path: Path, target: nn.Module, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    """Load a published-format DFlash or DFlash2 checkpoint (by its declared architecture),
    refusing one that does not fit `target`. The drafter borrows the target's embedding and LM head."""
    cfg = drafter_config(path)
    cfg.check_fits(target.cfg)
    src = {k.removeprefix("model."): v for k, v in read_safetensors(path).items()}

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise ValueError(f"drafter checkpoint {path} is missing tensor {name!r}")
        return src[name]

    state = {"fc.weight": take("fc.weight"), "hidden_norm.weight": take("hidden_norm.weight"),
             "norm.weight": take("norm.weight")}
    for i in range(cfg.model.num_layers):
        state.update(layer_state_dict(src, f"layers.{i}.", take))
    if isinstance(cfg, DFlash2Config):
        state.update(dflash2_tensors(src, cfg.model.num_layers, take))
    with torch.device("meta"):
        drafter = DFlash2Drafter(cfg) if isinstance(cfg, DFlash2Config) else DFlashDrafter(cfg)
    load_into(drafter, state, dtype, device)
    drafter.rotary = Rotary(cfg.model).to(device)
    return drafter.borrow(target.embed_tokens, target.lm_head).eval().requires_grad_(False)


def dflash2_tensors(src: dict[str, torch.Tensor], layers: int, take) -> dict[str, torch.Tensor]:
    """DFlash2's tensors under their published names: each layer's two convolutions and the
    selector (codebooks stored without a `.weight` suffix; one stored with it is taken too)."""
    out = {}
    for i in range(layers):
        for conv in CONVS:
            for name in ("base_kernel", "kernel_projection.weight"):
                out[f"layers.{i}.{conv}.{name}"] = take(f"layers.{i}.{conv}.{name}")
    for name in CODEBOOKS:
        full = f"candidate_selector.{name}"
        out[full] = take(full if full in src or f"{full}.weight" not in src else f"{full}.weight")
    out["candidate_selector.hidden_projection.weight"] = take("candidate_selector.hidden_projection.weight")
    return out
