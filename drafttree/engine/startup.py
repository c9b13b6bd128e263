"""Seconds per start-up stage (convert, load weights, graphs per phase, prefill graphs, warm-up),
logged one line each as they end and kept in order for a summary and the server's metrics."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class StartupTimes:
    stages: dict[str, float] = field(default_factory=dict)   # stage -> seconds, in the order run

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds
        log.info("start-up: %-22s %8.2f s", name, seconds)

    @property
    def total(self) -> float:
        return sum(self.stages.values())

    def summary(self) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.stages.items())
