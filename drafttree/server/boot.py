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
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def worker(self) -> EngineWorker | None:
        return self.serving.worker if self.serving is not None else None

    @property
    def ready(self) -> bool:
        return self.serving is not None and self.serving.worker.alive

    @property
    def alive(self) -> bool:
        return self.error is None and (self.serving is None or self.serving.worker.alive)

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
            engine = self.make()
            self.stage = "warming up"
            with engine.startup.stage("warm-up"):
                warm_up(engine)
            worker = EngineWorker(engine, self.metrics)
            serving = OpenAIServing(worker, self.model_name)
            self.seconds = time.perf_counter() - t0
            self.metrics.startup(engine.startup.stages, self.seconds)
            worker.start()
            self.serving, self.stage = serving, "ready"
            log.info("ready in %.2f s: %s (spec=%s, max_model_len=%d, max_num_seqs=%d, %s)", self.seconds,
                     self.model_name, engine.spec.method, engine.max_model_len, engine.cfg.max_num_seqs,
                     _graphs(engine))
            log.info("start-up stages: %s", engine.startup.summary())
        except BaseException as e:   # noqa: BLE001 (reported by /health and /ready, and by run_server)
            self.error, self.stage = e, "failed"
            log.exception("the engine failed to start")
            if self.on_failure is not None:
                self.on_failure()

    def stop(self) -> None:
        if self.serving is not None:
            self.serving.worker.stop()


def _graphs(engine: Engine) -> str:
    r = engine.runner
    if r.graphs is None:
        return "no CUDA graphs"
    pg = r.prefill_graphs
    offsets = 0 if pg is None else sum(L > 0 for _, _, L in pg.graphs)
    prefill = "prefill eager" if pg is None or pg.failed else \
        f"{len(pg.graphs)} prefill graphs ({len(pg.graphs) - offsets} from position 0, {offsets} at offsets)"
    return f"{len(r.graphs.graphs)} round graphs, {prefill}"
