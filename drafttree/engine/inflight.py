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
from drafttree.spec_decode.logits import LogitsBuffers
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
    processed: bool = False             # a processed round (logits processing, log-probabilities)
    lp_host: tuple[torch.Tensor, torch.Tensor] | None = None   # [B, C, 1 + K] each: the committed tokens' log-probabilities
    host_s: float = 0.0                 # host seconds between its draft and its verify (a constrained round's trees)
    host_rows: int = 0                  # the rows whose trees the host grew in them (those that follow a grammar)

    def logprobs(self, b: int, k: int, top: int) -> list[tuple[list[float], list[int]]] | None:
        """Row b's first k committed tokens' log-probabilities, each ([logprob, then the top
        `top`'s], [rank, then their ids]) (None: the round read none). After `read`, which waits
        for the copies; only the rows and columns asked for become Python numbers."""
        if self.lp_host is None:
            return None
        lp, ids = self.lp_host
        return list(zip(lp[b, :k, :1 + top].tolist(), ids[b, :k, :1 + top].tolist()))

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
        self.cuda = device.type == "cuda"   # width: the round state's out buffer's, 1 + C + P
        self.bufs = [torch.empty(rows, width, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.lp_bufs: list[tuple[torch.Tensor, torch.Tensor]] = []   # made at the first round that reads them
        self.next = 0

    def launch(self, state: RoundState, seqs: list[Sequence], t0: float, budget: int = 0,
               constrained: bool = False, processed: bool = False, logprobs: LogitsBuffers | None = None,
               host_s: float = 0.0, host_rows: int = 0) -> Launched:
        """Queue the copy of the round just launched over len(seqs) rows at `budget` (no host
        sync), and of its log-probabilities where `logprobs` (the round state's) is given; t0: the
        host time before its launch."""
        B, i = len(seqs), self.next
        self.next ^= 1
        lp_host = None
        if logprobs is not None:
            if not self.lp_bufs:
                self.lp_bufs = [(torch.empty(logprobs.lp.shape, pin_memory=self.cuda),
                                 torch.empty(logprobs.lp_ids.shape, dtype=torch.long, pin_memory=self.cuda))
                                for _ in range(2)]
            lp_host = (self.lp_bufs[i][0][:B], self.lp_bufs[i][1][:B])
            lp_host[0].copy_(logprobs.lp[:B], non_blocking=self.cuda)
            lp_host[1].copy_(logprobs.lp_ids[:B], non_blocking=self.cuda)
        dev = state.out[:B]
        host, done = self.bufs[i][:B], self.events[i]
        if done is None:
            return Launched(seqs, host.copy_(dev), None, t0, budget, constrained, processed, lp_host, host_s,
                            host_rows)
        host.copy_(dev, non_blocking=True)
        done.record()
        return Launched(seqs, host, done, t0, budget, constrained, processed, lp_host, host_s, host_rows)
