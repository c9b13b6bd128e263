"""The vocabulary-parallel embedding and LM head: rank r holds vocabulary rows r * S .. (r + 1) * S - 1,
S = ceil(V / N), the last rank's tail zero-padded. Tied models tie the two shards (the same rows).

The embedding looks up the ids in its rows (others give zeros) and all-reduces: one nonzero
addend per element, so the sum is exact and equals an unsharded lookup bit for bit. The head
computes its rows' logits and gathers them (then drops the padding): every rank holds the whole
[.., V] logits, so the target's pick, the draft tree and the acceptance walk are the same
computation on the same values on every rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafttree.kernels import dispatch
from drafttree.parallel.comm import all_reduce, gather_last
from drafttree.parallel.group import TPGroup


def vocab_shard(vocab: int, world: int) -> int:
    """Rows per rank: the vocabulary rounded up to a multiple of the ranks."""
    return -(-vocab // world)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.rows = vocab_shard(vocab, tp.world)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        return all_reduce(x.masked_fill(~mine[..., None], 0), self.tp)


class VocabParallelHead(nn.Module):
    """The LM head: [.., D] -> [.., V] logits on every rank."""

    def __init__(self, vocab: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.weight = nn.Parameter(torch.empty(vocab_shard(vocab, tp.world), dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _whole(gather_last(dispatch.linear(x, self.weight), self.tp), self.vocab)


def _whole(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The gathered logits without the padding rows' (a copy only where V is not a multiple of N)."""
    return logits if logits.shape[-1] == vocab else logits[..., :vocab].contiguous()


class GatheredLogits(nn.Module):
    """Another product of a head's rows, gathered as the head's (the drafter's fp8 copy, `models.quant`)."""

    def __init__(self, proj: nn.Module, head: VocabParallelHead) -> None:
        super().__init__()
        self.proj, self.vocab, self.tp = proj, head.vocab, head.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _whole(gather_last(self.proj(x), self.tp), self.vocab)
