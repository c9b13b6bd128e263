"""The one place where every phase's width per request is defined.

Capture plans, static buffers, attention masks, KV reservations and logits rows all ask
`SpecConfig.width(phase)`. DDTree verifies `budget + 1` tokens while it drafts `block_size`:
the two are different numbers and nothing may assume otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    PREFILL = "prefill"   # variable width, runs eagerly
    DECODE = "decode"     # plain autoregressive step of the target
    DRAFT = "draft"       # one drafter forward over [bonus, MASK * (block_size - 1)]
    VERIFY = "verify"     # one target forward over the draft (chain or tree)


METHODS = ("none", "dflash", "ddtree")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"
    block_size: int = 0   # draft width; 0 when no drafter
    budget: int = 0       # DDTree tree nodes, root excluded

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown spec method {self.method!r}; choose one of {METHODS}")
        if self.method != "none" and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 for {self.method}, got {self.block_size}")
        if self.method == "ddtree" and self.budget < 1:
            raise ValueError(f"ddtree needs budget >= 1, got {self.budget}")

    @property
    def speculative(self) -> bool:
        return self.method != "none"

    @property
    def depth(self) -> int:
        """Deepest draft position; at most depth + 1 tokens commit per round."""
        return self.block_size - 1 if self.speculative else 0

    def width(self, phase: Phase) -> int:
        if phase is Phase.DECODE:
            return 1
        if phase is Phase.DRAFT:
            return self.block_size
        if phase is Phase.VERIFY:
            return self.budget + 1 if self.method == "ddtree" else self.block_size
        raise ValueError(f"{phase.value} has no fixed width")

    @property
    def round_phases(self) -> tuple[Phase, ...]:
        return (Phase.DRAFT, Phase.VERIFY) if self.speculative else (Phase.DECODE,)

    @property
    def max_commit(self) -> int:
        """Tokens one round can commit per request (accepted path incl. bonus)."""
        return self.block_size if self.speculative else 1

    @property
    def kv_headroom(self) -> int:
        """Cache slots a round may write past the committed length (target and drafter)."""
        if not self.speculative:
            return 1
        return max(self.width(Phase.VERIFY), self.width(Phase.DRAFT))
