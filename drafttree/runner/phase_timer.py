"""Seconds spent per phase, without host syncs: CUDA events are read after the round's own sync."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._pending.append((name, a, b))
        else:
            t0 = time.perf_counter()
            yield
            self.totals[name] += time.perf_counter() - t0

    def reset(self) -> None:
        self.totals.clear()
        self._pending.clear()

    def collect(self) -> None:
        """Add the pending CUDA intervals the device has finished (in launch order: a round
        launched after the one just read may still run)."""
        done = 0
        for name, a, b in self._pending:
            if not b.query():
                break
            self.totals[name] += a.elapsed_time(b) / 1e3
            done += 1
        del self._pending[:done]
