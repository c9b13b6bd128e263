"""Load a DFlash drafter checkpoint (the published format, unchanged) for a loaded target."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from drafttree.loader.weights import layer_state_dict, load_into, read_safetensors
from drafttree.models.dflash import DFlashConfig, DFlashDrafter
from drafttree.models.layers import Rotary


def load_drafter(path: Path, target: nn.Module, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    """Load a published-format DFlash checkpoint, refusing one that does not fit `target`.
    The drafter borrows the target's embedding and LM head."""
    cfg = DFlashConfig.from_dir(path)
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
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    load_into(drafter, state, dtype, device)
    drafter.rotary = Rotary(cfg.model).to(device)
    return drafter.borrow(target.embed_tokens, target.lm_head).eval().requires_grad_(False)
