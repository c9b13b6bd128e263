"""Start-up, reported as it goes: seconds per stage (convert, load weights, kv cache, tokenizer,
kernels, graphs per phase, prefill graphs, cost model, warm-up), one line each as it ends, and
while a stage runs longer than PROGRESS_EVERY_S a progress line that often (what runs, how far,
seconds so far), from a thread of its own. Lines go to the `drafttree.engine.startup` logger:
the command line shows them on stderr, the server in its log. The stages are kept in order for
a summary, the server's metrics and the benchmarks' records.

Work that need not wait for the stage before it runs alongside it (`Background`: the tokenizer
loads while the weights do)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

PROGRESS_EVERY_S = 2.0   # the longest a running stage stays silent


@dataclass
class StartupTimes:
    stages: dict[str, float] = field(default_factory=dict)   # stage -> seconds, in the order run
    notes: dict[str, str] = field(default_factory=dict)      # stage -> what it did (a cache hit, counts)
    parts: dict[str, dict[str, float]] = field(default_factory=dict)   # stage -> seconds of its parts (graph sets)
    every_s: float = PROGRESS_EVERY_S
    emit: Callable[[str], None] = field(default=lambda line: log.info("%s", line), repr=False)
    _running: list[tuple[str, float]] = field(default_factory=list, repr=False)   # (name, start), innermost last
    _detail: str = field(default="", repr=False)
    _last_line: float = field(default=0.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _wake: threading.Event = field(default_factory=threading.Event, repr=False)
    _ticking: bool = field(default=False, repr=False)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage `name` (its seconds added to any earlier ones of that name)."""
        t0 = time.perf_counter()
        with self.running(name):
            yield
        self.add(name, time.perf_counter() - t0)

    @contextmanager
    def running(self, name: str) -> Iterator[None]:
        """Progress lines for the block, without recording it: for a block whose parts are added
        as stages of their own (`add`), such as the graphs of each phase."""
        with self._lock:
            self._running.append((name, time.perf_counter()))
            self._detail = ""
            self._last_line = time.perf_counter()
            if not self._ticking:
                self._ticking = True
                threading.Thread(target=self._tick, name="drafttree-startup-progress", daemon=True).start()
        try:
            yield
        finally:
            with self._lock:
                self._running.pop()
                self._detail = ""
            self._wake.set()

    def progress(self, detail: str) -> None:
        """What the running stage does now (shown in its next progress line)."""
        self._detail = detail

    def add(self, name: str, seconds: float, note: str = "") -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds
        if note:
            self.notes[name] = note
        note = self.notes.get(name, "")
        self._line(f"start-up: {name:<22} {seconds:8.2f} s" + (f"  ({note})" if note else ""))

    def note(self, name: str, note: str) -> None:
        """Say what stage `name` did (shown in the summary)."""
        self.notes[name] = note

    @property
    def total(self) -> float:
        return sum(self.stages.values())

    def summary(self) -> str:
        return ", ".join(f"{k} {v:.2f} s" + (f" ({self.notes[k]})" if k in self.notes else "")
                         for k, v in self.stages.items())

    def record(self) -> dict[str, Any]:
        """Stages, notes and total, JSON-ready (benchmark records)."""
        return {"stages": {k: round(v, 4) for k, v in self.stages.items()}, "notes": dict(self.notes),
                "parts": {k: {p: round(s, 4) for p, s in v.items()} for k, v in self.parts.items()},
                "total_s": round(self.total, 4)}

    # -- progress lines ------------------------------------------------------------------------
    def _line(self, text: str) -> None:
        self._last_line = time.perf_counter()
        self.emit(text)

    def _tick(self) -> None:
        while True:
            with self._lock:
                if not self._running:
                    self._ticking = False
                    return
                name, t0 = self._running[-1]
                detail, last = self._detail, self._last_line
            now = time.perf_counter()
            if now - last >= self.every_s:
                self._line(f"start-up: {name}: {detail + ', ' if detail else ''}{now - t0:.0f} s so far")
                last = now
            self._wake.wait(max(0.05, min(self.every_s, last + self.every_s - now)))
            self._wake.clear()


class Background(Generic[T]):
    """fn() run in a thread of its own from now; `result()` waits for it (and raises its error)."""

    def __init__(self, fn: Callable[[], T], name: str = "drafttree-startup") -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn()
        except BaseException as e:   # noqa: BLE001 (raised again by result(), on the caller's thread)
            self._error = e
        self.seconds = time.perf_counter() - t0

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value   # type: ignore[return-value]
