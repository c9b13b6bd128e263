"""Microseconds per call of a CUDA function, timed as a CUDA graph of n calls (no launch gaps)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from drafttree.runner.cuda_graph import warm_up


def graphed(fn: Callable[[], Any], n: int = 50, replays: int = 10) -> tuple[float, Any]:
    """(µs per call, what the graph's last call returned; read it after a replay)."""
    warm_up(fn, times=3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            out = fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * n), out


def graphed_us(fn: Callable[[], Any], n: int = 50, replays: int = 10) -> float:
    return graphed(fn, n, replays)[0]
