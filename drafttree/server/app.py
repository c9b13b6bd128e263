"""The OpenAI-compatible HTTP server: `create_app` for an engine, `run_server` from a config."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.engine.launch import follow, start_engine
from drafttree.parallel.group import TensorParallelError
from drafttree.server.metrics import CONTENT_TYPE, ServerMetrics
from drafttree.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, error_body, now
from drafttree.server.serving import OpenAIServing, Reply
from drafttree.server.worker import EngineWorker

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not loc:
        return f"invalid request body: {err.get('msg')}", None
    where = ".".join(loc)
    return f"invalid value for '{where}': {err.get('msg')}", loc[0]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"),
                            status_code=500)


def create_app(engine: Engine, model_name: str, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """An app serving `engine` under `model_name`; its engine thread runs while the app is up.
    `on_fatal(message)`: the engine stopped for good (a tensor-parallel rank lost)."""
    metrics = ServerMetrics()
    worker = EngineWorker(engine, metrics, on_fatal)
    serving = OpenAIServing(worker, model_name)
    created = now()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="drafttree", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not worker.alive or engine.failure is not None:
            return JSONResponse({"status": engine.failure or worker.fatal or "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "drafttree",
            "max_model_len": engine.max_model_len, "speculative": engine.spec.method}]}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/engine")
    async def debug_engine() -> dict[str, int]:
        """Request counts as the engine thread last saw them (for tests and operators)."""
        return {"running": worker.num_running, "waiting": worker.num_waiting, "live": worker.num_live}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Reply:
        return await serving.chat(req, raw)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, raw: Request) -> Reply:
        return await serving.completion(req, raw)

    return app


def run_server(cfg: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               model_name: str | None = None) -> None:
    """Load the engine (weights, CUDA graphs) and serve it until interrupted."""
    import uvicorn

    from drafttree.loader.default_model import DEFAULT_MODEL_NAME

    engine = start_engine(cfg)
    if not engine.leader:   # a torchrun rank other than 0: the server is rank 0's
        follow(engine)
        return
    name = model_name or cfg.model or DEFAULT_MODEL_NAME
    log.info("serving %s (spec=%s, max_model_len=%d%s) on http://%s:%d", name, engine.spec.method,
             engine.max_model_len, f", tensor_parallel_size={engine.world}" if engine.world > 1 else "", host, port)
    fatal: list[str] = []

    def stop(message: str) -> None:   # the engine thread: ask uvicorn to end, as on SIGTERM
        fatal.append(message)
        server.should_exit = True

    server = uvicorn.Server(uvicorn.Config(create_app(engine, name, stop), host=host, port=port, log_level="info"))
    try:
        server.run()
    finally:
        engine.shutdown()
    if fatal:
        raise TensorParallelError(fatal[0])
