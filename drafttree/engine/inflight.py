"""Rounds launched but not yet read: the engine launches round N+1 before it reads round N's
tokens (`EngineConfig.overlap`), so the host's work between rounds (reading, emitting, the next
launch) runs while the device computes instead of leaving it idle.

Each launched round's committed tokens go to host memory as the device gets there: a copy into
one of two pinned buffers, then an event. Reading waits on that event alone, never on the rounds
launched after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafttree.engine.sequence import Sequence
from drafttree.spec_decode.state import RoundState


@dataclass
class Launched:
    """A round over rows 0..B-1; row i held seqs[i] when it was launched (rows move as requests
    finish, so a late read maps by this list, not by seq.row)."""
    seqs: list[Sequence]
    host: torch.Tensor                  # [B, 1 + C + P]: out_n, out_tokens, then out_pred
    done: torch.cuda.Event | None       # recorded after the copy (CUDA)
    t0: float                           # host time before the launch
    budget: int = 0                     # the round's budget (0: a decode round)
    constrained: bool = False           # a constrained round (structured output): read before the next launch

    def read(self) -> list[list[int]]:
        """Per row: out_n, the committed tokens, then the predictions; a decode round's rows
        only out_n and its one token (what the engine reads of them)."""
        if self.done is not None:
            self.done.synchronize()
        return (self.host if self.budget else self.host[:, :2]).tolist()

    @property
    def abandoned(self) -> bool:
        """Every request of the round finished (EOS, stop, abort) after it was launched."""
        return all(s.finished for s in self.seqs)


class RoundOutputs:
    """Two pinned host buffers and their events, alternating: a round's buffer (and event) is used
    again two launches later, after the engine has read (or abandoned) that round; the copies run
    in stream order."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        cuda = device.type == "cuda"   # width: the round state's out buffer's, 1 + C + P
        self.bufs = [torch.empty(rows, width, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.next = 0

    def launch(self, state: RoundState, seqs: list[Sequence], t0: float, budget: int = 0,
               constrained: bool = False) -> Launched:
        """Queue the copy of the round just launched over len(seqs) rows at `budget` (no host
        sync); t0: the host time before its launch."""
        B, i = len(seqs), self.next
        self.next ^= 1
        dev = state.out[:B]
        host, done = self.bufs[i][:B], self.events[i]
        if done is None:
            return Launched(seqs, host.copy_(dev), None, t0, budget, constrained)
        host.copy_(dev, non_blocking=True)
        done.record()
        return Launched(seqs, host, done, t0, budget, constrained)
