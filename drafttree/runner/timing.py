"""The one timing routine: seconds per run of a function, each run from a reset state, on CUDA
between events (device time), elsewhere by the host clock; and the graph timer, which times a
CUDA graph of many calls (no launch gaps). The cost model, `bench.phases` and the kernel
benchmarks take their figures from here."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from drafttree.runner.capture import capture_graph


def run_seconds(fn: Callable[[], object], reset: Callable[[], None], device: torch.device, reps: int,
                warmups: int = 1) -> list[float]:
    """Seconds of each of `reps` runs of fn, after `warmups` untimed ones; reset() (untimed)
    before every run."""
    for _ in range(warmups):
        reset()
        fn()
    out = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(reps):
        reset()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def median_seconds(fn: Callable[[], object], reset: Callable[[], None], device: torch.device, reps: int,
                   warmups: int = 1) -> float:
    return statistics.median(run_seconds(fn, reset, device, reps, warmups))


def graphed(fn: Callable[[], Any], n: int = 50, replays: int = 10) -> tuple[float, Any]:
    """(µs per call of fn, timed as a CUDA graph of n calls replayed `replays` times; what the
    graph's last call returned: read it after a replay)."""
    box: list[Any] = [None]

    def calls() -> None:
        for _ in range(n):
            box[0] = fn()
    graph = capture_graph(calls, warmups=1)
    graph.replay()
    seconds = run_seconds(lambda: [graph.replay() for _ in range(replays)], lambda: None, torch.device("cuda"), 1, 0)
    return seconds[0] * 1e6 / (replays * n), box[0]
