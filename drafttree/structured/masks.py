"""Token masks on the device: a bitmask per row and node (int32 words, bit t % 32 of word t // 32:
token t allowed), applied to the target's logits before its pick, so every sampling rule (argmax,
the seeded noise, top-k / top-p) chooses among the allowed tokens only."""
from __future__ import annotations

import numpy as np
import torch

from drafttree.kernels.fused import fused


def token_bits(words: np.ndarray, vocab: int) -> np.ndarray:
    """masks [..., words] int32 -> [..., vocab] uint8, 1 where the token is allowed (numpy: the
    words as little-endian bytes, whose bit t is token t, unpacked)."""
    return np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), axis=-1, count=vocab,
                         bitorder="little")


def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """logits [R, N, V] with the tokens masks [R, N, words] forbid at -inf: a new tensor, or with
    `in_place` (the caller reads the unmasked logits no more) logits itself where that saves a
    copy (on the CPU)."""
    if logits.device.type == "cpu":
        return _apply_on_host(logits if in_place and logits.is_contiguous() else
                              logits.clone(memory_format=torch.contiguous_format), masks)
    return _apply(logits, masks)


@fused
def _apply(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    # each word's 32 bits side by side, then cut at V: no gather of a word per token (which
    # took five times as long in torch ops on the CPU, where nothing fuses them)
    bits = torch.arange(32, dtype=masks.dtype, device=masks.device)
    forbidden = ((masks.unsqueeze(-1) >> bits) & 1).flatten(-2)[..., :V] == 0
    return logits.masked_fill(forbidden, float("-inf"))


def _apply_on_host(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """`_apply` in place on the CPU, where no kernel fuses its passes over [R, N, V]: only the
    nodes whose mask forbids a token are masked (a batch's free rows allow every token), their
    bits unpacked by numpy (`token_bits`)."""
    V = logits.shape[-1]
    m = masks.reshape(-1, masks.shape[-1])
    need = (m != -1).any(-1).nonzero().flatten()
    if need.numel():
        forbidden = torch.from_numpy(token_bits(m[need].numpy(), V)) == 0
        flat = logits.view(-1, V)
        if need.numel() == flat.shape[0]:
            flat.masked_fill_(forbidden, float("-inf"))
        else:
            flat[need] = flat[need].masked_fill_(forbidden, float("-inf"))
    return logits
