"""Rank 0's step commands: the runner calls that change device state (a prefill, a round, a row's
pages, a row's move), sent to the other ranks on the gloo group before rank 0 runs them, so that
every rank runs the same forwards with the same collectives in the same order. Rank 0 owns the
scheduler, the tokenizer and the server; the others hold only models, caches and the round state,
and follow (`engine.launch.follow`).

A command is its method's name and arguments (host values: lists, ints, dataclasses), one
`broadcast_object_list`. While rank 0 is idle it sends a heartbeat every HEARTBEAT_S, so that a
follower waiting for its next command tells an idle rank 0 from a lost one (its wait times out
after the group's timeout).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from drafttree.parallel.group import TPGroup

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

NOOP, SHUTDOWN = "noop", "shutdown"
HEARTBEAT_S = 5.0
COMMANDS: set[str] = set()   # the runner methods a follower may be told to run


class CommandChannel:
    def __init__(self, tp: TPGroup, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.tp = tp
        self.heartbeat_s = min(heartbeat_s, tp.timeout_s / 4)
        # Held while a command is sent and run: the heartbeat never lands between them, and a
        # command's own host agreements (the gloo group) never meet a heartbeat's broadcast.
        self.lock = threading.RLock()
        self.last = time.monotonic()
        self.failure: str | None = None   # what the watcher or the heartbeat saw: a rank lost
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def send(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        with self.lock:
            dist.broadcast_object_list([(name, args, kwargs or {})], src=0, group=self.tp.cpu)
            self.last = time.monotonic()

    def receive(self) -> tuple[str, tuple, dict[str, Any]]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.cpu)
        return box[0]

    def start_heartbeat(self) -> None:
        self._beat = threading.Thread(target=self._heartbeat, name="drafttree-tp-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 2):
            if time.monotonic() - self.last < self.heartbeat_s:
                continue
            try:
                with self.lock:
                    if self._stop.is_set():   # closed meanwhile: no heartbeat after the farewell
                        return
                    self.send(NOOP)
            except Exception as e:   # a follower is gone: the next step says so
                if not self._stop.is_set():
                    self.failure = self.failure or f"a tensor-parallel rank stopped answering ({str(e).splitlines()[0]})"
                    log.error("%s", self.failure)
                return

    def close(self, farewell: bool = True) -> None:
        """Stop the heartbeat and tell the followers to stop (`farewell`; best effort: some may be gone)."""
        self._stop.set()
        if farewell and self.failure is None:
            try:
                self.send(SHUTDOWN)
            except Exception as e:
                log.warning("could not tell the tensor-parallel ranks to stop: %s", e)
        if self._beat is not None:
            self._beat.join(timeout=self.heartbeat_s)


def command(fn: F) -> F:
    """A runner method that rank 0 sends to the other ranks before running it (its `channel`;
    None on the other ranks, on a single device, and where every rank runs the same code)."""
    COMMANDS.add(fn.__name__)

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        channel: CommandChannel | None = self.channel
        if channel is None:
            return fn(self, *args, **kwargs)
        with channel.lock:
            channel.send(fn.__name__, args, kwargs)
            return fn(self, *args, **kwargs)
    return run  # type: ignore[return-value]
