"""Start-up behind a listening server: the engine is built (weights, CUDA graphs, prefill graphs
per (rows, length bucket, attention length): from position 0 and at offsets, for prefix-cache
hits and continuing chunks) and warmed up in a thread while the HTTP server already answers. The
ready line counts the graphs of each kind.

`/health` is liveness: 200 while the process is up and its engine is loading or running, 503 once
the engine failed to start or its thread died (restart the process). `/ready` is readiness: 200
only after warm-up, when the engine thread runs; 503 before (with the stage) and after a failure.
A load balancer sends traffic on `/ready`; until then completion requests get 503 with
Retry-After, so a request never pays for a capture or a compile."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from drafttree.engine.engine import Engine
from drafttree.engine.warmup import warm_up
from drafttree.server.metrics import ServerMetrics
from drafttree.server.serving import OpenAIServing
from drafttree.server.worker import EngineWorker

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5


@dataclass
class Boot:
    """Builds, warms and starts the engine once; read by the routes from any thread."""
    make: Callable[[], Engine]
    model_name: str
    metrics: ServerMetrics
    on_failure: Callable[[], None] | None = None
    stage: str = "not started"
    error: BaseException | None = None
    serving: OpenAIServing | None = None   # set when ready
    seconds: float | None = None           # from the start of `run` to ready
    engine: Engine | None = None           # once built
    _thread: threading.Thread | None = field(default=None, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def worker(self) -> EngineWorker | None:
        return self.serving.worker if self.serving is not None else None

    @property
    def fatal(self) -> str | None:
        """Why the running engine stopped for good (a tensor-parallel rank lost), or None."""
        return self.worker.fatal if self.worker is not None else None

    @property
    def failure(self) -> str | None:
        """`fatal`, or a loss the engine thread has not seen yet (it looks every second while idle)."""
        w = self.worker
        return None if w is None else w.fatal or w.engine.failure

    @property
    def ready(self) -> bool:
        return self.serving is not None and self.serving.worker.alive and self.failure is None

    @property
    def alive(self) -> bool:
        return self.error is None and (self.serving is None or (self.serving.worker.alive and self.failure is None))

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="drafttree-startup", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.stage = "loading the engine (weights, CUDA graphs)"
            engine = self.engine = self.make()
            if self._stopped(engine):
                return
            self.stage = "warming up"
            with engine.startup.stage("warm-up"):
                # tensor-parallel: rank 0's steps, which the other ranks follow
                warm_up(engine, engine.startup.progress)
            worker = EngineWorker(engine, self.metrics, lambda _: self._failed())
            serving = OpenAIServing(worker, self.model_name)
            self.seconds = time.perf_counter() - t0
            self.metrics.startup(engine.startup.stages, self.seconds)
            self.metrics.sync(engine)   # the pool's gauges are true from the first /ready on
            with self._lock:
                if self._stopped(engine):
                    return
                worker.start()
                self.serving, self.stage = serving, "ready"
            log.info("ready in %.2f s: %s (spec=%s, max_model_len=%d, max_num_seqs=%d, %s)", self.seconds,
                     self.model_name, engine.spec.method, engine.max_model_len, engine.cfg.max_num_seqs,
                     _graphs(engine))
            log.info("start-up stages: %s", engine.startup.summary())
        except BaseException as e:   # noqa: BLE001 (reported by /health and /ready, and by run_server)
            self.error, self.stage = e, "failed"
            log.exception("the engine failed to start")
            if self.engine is not None:
                self.engine.shutdown()
            self._failed()

    def _stopped(self, engine: Engine) -> bool:
        """Whether the server ended while the engine started: then it is shut down here, on the
        thread that steps it (`stop` leaves an engine still starting to this thread)."""
        if not self._stopping.is_set():
            return False
        self.stage = "stopped"
        engine.shutdown()
        return True

    def _failed(self) -> None:
        if self.on_failure is not None:
            self.on_failure()

    def stop(self) -> None:
        """Stop the engine thread, then the engine's tensor-parallel ranks (nothing on one device)."""
        with self._lock:
            self._stopping.set()
            serving = self.serving
        if serving is not None:
            serving.worker.stop()
            serving.worker.engine.shutdown()


def _graphs(engine: Engine) -> str:
    return engine.runner.describe_graphs()
