"""Token masks on the device: a bitmask per row and node (int32 words, bit t % 32 of word t // 32:
token t allowed), applied to the target's logits before its pick, so every sampling rule (argmax,
the seeded noise, top-k / top-p) chooses among the allowed tokens only."""
from __future__ import annotations

import torch

from drafttree.kernels.fused import fused


@fused
def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [R, N, V] with the tokens masks [R, N, words] forbid at -inf (a new tensor)."""
    V = logits.shape[-1]
    # each word's 32 bits side by side, then cut at V: no gather of a word per token (which
    # took five times as long in torch ops on the CPU, where nothing fuses them)
    bits = torch.arange(32, dtype=masks.dtype, device=masks.device)
    forbidden = ((masks.unsqueeze(-1) >> bits) & 1).flatten(-2)[..., :V] == 0
    return logits.masked_fill(forbidden, float("-inf"))
