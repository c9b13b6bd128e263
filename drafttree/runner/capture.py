"""The one CUDA graph capture routine: warm the function up on a side stream, then capture it.

Round graphs, prefill graphs, the benchmarks' graphs and the graph timer all capture through
`capture_graph`, so that every graph is made the same way (allocator and Triton compiles warmed
first; no collective in flight when a tensor-parallel capture starts; Python's cyclic collector
off while capturing).
"""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

import torch


def warm_up(fn: Callable[[], object], times: int = 2, reset: Callable[[], None] | None = None) -> None:
    """Run fn on a side stream before capturing it: allocator, Triton compiles, cuBLAS picks;
    reset() (if given) before each run."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            if reset is not None:
                reset()
            fn()
    torch.cuda.current_stream().wait_stream(side)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector runs first and then stays off while graphs are captured: objects
    it would free mid-capture (an earlier engine's tensors, events, pinned buffers) may make CUDA
    calls that a capture forbids, and the capture fails."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def settle_collector() -> None:
    """Collect, then freeze what is left alive into Python's permanent generation. For a process
    that holds one engine for good (a server, a tensor-parallel rank): after start-up it holds
    hundreds of thousands of objects (modules, compiled pieces and their guards, graphs), and the
    cyclic collector walks every one of them at each full collection: `collector_paused`'s before
    each graph captured while idle, and those Python starts itself between rounds. Frozen, a
    collection walks only what came since; called again after each piece of idle work, so that
    what it compiled is frozen too. `thaw_collector` undoes it when the engine goes."""
    gc.collect()
    gc.freeze()


def thaw_collector() -> None:
    """Give the frozen objects back to the collector (`settle_collector`): an engine that ends
    in a process that goes on (tests, a notebook) leaves its cycles collectable."""
    gc.unfreeze()


def capture_graph(fn: Callable[[], object], pool=None, *, collectives: bool = False, other_threads: bool = False,
                  warmups: int = 2, reset: Callable[[], None] | None = None, seconds: dict[str, float] | None = None,
                  label: str = "graph") -> torch.cuda.CUDAGraph:
    """Capture fn into a CUDA graph (in memory pool `pool`), after `warmups` runs on a side stream,
    reset() (if given: a state fn may run from, not part of the graph) before each run and before
    the capture.

    collectives: fn runs tensor-parallel collectives: the device is synchronized first (no
    collective of the warm-up still runs when the capture's own start), and the capture is
    thread-local (NCCL's watchdog thread queries events of earlier work meanwhile, which a global
    capture forbids). other_threads: another thread may make CUDA calls meanwhile (a server's
    event loop): thread-local too. `seconds` (if given) gains the host seconds of the warm-up
    ("warm-up") and of the capture (`label`)."""
    t0 = time.perf_counter()
    if warmups:
        warm_up(fn, warmups, reset)
    if reset is not None:
        reset()
    if collectives:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    mode = "thread_local" if collectives or other_threads else "global"
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        fn()
    if seconds is not None:
        seconds["warm-up"] = seconds.get("warm-up", 0.0) + t1 - t0
        seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t1
    return graph
