"""The DFlash training recipe as pure functions: anchors, blocks, labels, the training attention
mask, the per-position loss weights, the batching and the LR schedule. Which target layers feed
a drafter is a fact of the drafter's shape (`models.dflash.default_target_layer_ids`).

Layout: a batch row holds N blocks of `bs` tokens, flattened to W = N*bs query positions.
Block n of row b is [ids[a], MASK * (bs-1)] at positions a..a+bs-1 with a = anchors[b, n];
its label at block position k >= 1 is ids[a+k]. It sees context features at positions < a
(those of committed tokens: at inference the anchor is the bonus token, whose features do not
exist yet) and its own block, bidirectionally.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from drafttree.models.dflash import default_target_layer_ids  # noqa: F401  (a drafter-shape fact)

IGNORE = -100
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))   # block size -> gamma, from the paper


def default_gamma(block_size: int) -> float:
    """Loss decay: 4 / 5 / 7 for block sizes 8 / 10 / 16, linear between and beyond (>= 1)."""
    pts = _GAMMA_POINTS
    if block_size <= pts[1][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    else:
        (x0, y0), (x1, y1) = pts[1], pts[2]
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[bs] weights: 0 at the anchor, exp(-(k-1)/gamma) at block position k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(prompt_lens: list[int], lengths: list[int], max_anchors: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` distinct anchors per row, uniform over response positions that have
    at least one label after them: a in [prompt_len, length-2]. Sorted; padded with 0.
    Returns anchors [B, N] long and valid [B, N] bool."""
    picks = []
    for p, n in zip(prompt_lens, lengths):
        lo, count = max(p, 0), max(n - 1 - max(p, 0), 0)
        k = min(max_anchors, count)
        idx = torch.randperm(count, generator=gen)[:k] if k < count else torch.arange(count)
        picks.append((idx.sort().values + lo) if k else torch.zeros(0, dtype=torch.long))
    N = max(1, max(len(a) for a in picks))
    anchors = torch.zeros(len(picks), N, dtype=torch.long)
    valid = torch.zeros(len(picks), N, dtype=torch.bool)
    for b, a in enumerate(picks):
        anchors[b, :len(a)] = a
        valid[b, :len(a)] = True
    return anchors, valid


@dataclass
class Blocks:
    ids: torch.Tensor        # [B, W] block input ids
    pos: torch.Tensor        # [B, W] absolute positions
    labels: torch.Tensor     # [B, W] target ids, IGNORE where not in the loss
    anchors: torch.Tensor    # [B, N] (0 where not valid)
    block_size: int

    def ctx_mask(self, T: int) -> torch.Tensor:
        return context_mask(self.anchors, T, self.block_size)

    def dense_mask(self, T: int) -> torch.Tensor:
        """[B, W, T + W] over keys [T context positions ; W block tokens]: the context before
        the block's anchor and the block's own tokens, never another block."""
        return block_mask(self.anchors, T, self.block_size)


def build_blocks(input_ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 valid: torch.Tensor, block_size: int, mask_token_id: int) -> Blocks:
    """input_ids [B, T] (padded), lengths [B], anchors/valid [B, N] -> the blocks' inputs and
    labels; the attention masks follow from the anchors (`Blocks.ctx_mask` / `dense_mask`)."""
    B, T = input_ids.shape
    N, bs = anchors.shape[1], block_size
    dev = input_ids.device
    k = torch.arange(bs, device=dev)
    pos = anchors[:, :, None] + k                                          # [B, N, bs]
    ids = torch.full((B, N, bs), mask_token_id, dtype=torch.long, device=dev)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    in_seq = (pos < lengths[:, None, None]) & valid[:, :, None] & (k > 0)
    labels = input_ids.gather(1, pos.clamp(max=T - 1).view(B, -1)).view(B, N, bs)
    labels = torch.where(in_seq, labels, torch.full_like(labels, IGNORE))
    return Blocks(ids.view(B, -1), pos.view(B, -1), labels.view(B, -1), anchors, bs)


def context_mask(anchors: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """[B, N*bs, T]: a query in block n sees context positions j < anchors[n]."""
    q_anchor = anchors.repeat_interleave(block_size, dim=1)               # [B, W]
    return torch.arange(T, device=anchors.device)[None, None, :] < q_anchor[:, :, None]


def block_mask(anchors: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """[B, N*bs, T + N*bs]: query in block n sees context j < anchors[n] and block n only."""
    B, N = anchors.shape
    blk = torch.arange(N * block_size, device=anchors.device) // block_size
    own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
    return torch.cat([context_mask(anchors, T, block_size), own], dim=2)


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled batches of similar lengths (sorted within groups of 32 batches)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    group, batches = 32 * batch_size, []
    for s in range(0, len(perm), group):
        chunk = sorted(perm[s:s + group], key=lambda i: lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def cosine_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f
