"""Microseconds per call of a CUDA function, timed as a CUDA graph of n calls (no launch gaps:
`runner.timing.graphed`), and weights that come from HBM on every call."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from drafttree.runner.timing import graphed


def graphed_us(fn: Callable[[], Any], n: int = 50, replays: int = 10) -> float:
    return graphed(fn, n, replays)[0]


COLD_BYTES = 128 << 20   # more than an H200's 50 MiB L2, with room


def weight_copies(n: int, k: int, copies: int | None = None, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Random [n, k] weights on CUDA, at least 8 and by default as many as exceed COLD_BYTES
    together, so that a graph that calls once per copy (`cycling`, n ≥ the copies) reads each
    weight from HBM, as a forward does; fewer copies of a small weight would stay in L2."""
    size = n * k * torch.finfo(dtype).bits // 8
    copies = copies or max(8, -(-COLD_BYTES // size))
    return [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for _ in range(copies)]


def cycling(make: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> Callable[[], Any]:
    """A call that runs make(the next of `weights`) each time."""
    state = [0]

    def call() -> Any:
        state[0] = (state[0] + 1) % len(weights)
        return make(weights[state[0]])
    return call
