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
    ids = torch.arange(V, device=logits.device)
    words = masks.index_select(-1, ids >> 5)
    allowed = ((words >> (ids & 31).to(words.dtype)) & 1) != 0
    return logits.masked_fill(~allowed, float("-inf"))
