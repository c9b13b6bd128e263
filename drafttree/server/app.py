"""The OpenAI-compatible HTTP server: `create_app` for an engine, `run_server` from a config."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.engine.launch import check_launch, follow, start_engine
from drafttree.parallel.group import TensorParallelError
from drafttree.server.boot import RETRY_AFTER_S, Boot
from drafttree.server.limits import ApiKey, BodySizeLimit, ServerLimits
from drafttree.server.metrics import CONTENT_TYPE, ServerMetrics
from drafttree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    error_body,
    now,
)
from drafttree.server.serving import OpenAIServing, Reply
from drafttree.version import __version__

log = logging.getLogger(__name__)


# Fields that take one of several types: pydantic reports each alternative under a type's name
# ('prompt.str: Input should be a valid string' for a bad list of token ids); say what is allowed.
UNION_FIELDS = {
    ("prompt",): "must be a string, a list of token ids (integers >= 0), or a list holding one of those",
    ("stop",): "must be a string or a list of strings",
    ("messages", "*", "content"): 'must be a string or a list of text parts ({"type": "text", "text": "..."})',
}


UNREADABLE_BODY = "There was an error parsing the body"


def _where(loc: list[str | int]) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [x for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not loc:
        return f"invalid request body: {err.get('msg')}", None
    for n in range(1, len(loc) + 1):
        key = tuple("*" if isinstance(x, int) else x for x in loc[:n])
        if key in UNION_FIELDS:
            return f"{_where(loc[:n])} {UNION_FIELDS[key]}", str(loc[0])
    return f"invalid value for '{_where(loc)}': {err.get('msg')}", str(loc[0])


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        if exc.status_code == 400 and message == UNREADABLE_BODY:   # FastAPI's words for bytes not UTF-8
            message = "the request body is not valid JSON: it must be UTF-8 text"
        return JSONResponse(error_body(message, type=kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"),
                            status_code=500)


def create_app(engine: Engine | Callable[[], Engine], model_name: str, limits: ServerLimits | None = None,
               on_failure: Callable[[], None] | None = None) -> FastAPI:
    """An app serving `engine` (or the engine `engine()` builds, in a start-up thread) under
    `model_name`. It listens at once; /ready answers 200 once the engine is warm (server/boot.py).
    `on_failure()`: the engine failed to start, or stopped for good (a tensor-parallel rank lost)."""
    limits = limits or ServerLimits()
    metrics = ServerMetrics(model_name=model_name)
    make = (lambda: engine) if isinstance(engine, Engine) else engine
    boot = Boot(make, model_name, metrics, on_failure)
    created = now()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        boot.start()
        try:
            yield
        finally:
            boot.stop()

    app = FastAPI(title="drafttree", version=__version__, lifespan=lifespan)
    app.state.boot, app.state.metrics, app.state.limits = boot, metrics, limits
    app.add_middleware(BodySizeLimit, limit=limits.max_request_bytes)
    if limits.api_key is not None:   # added after, so it runs before
        app.add_middleware(ApiKey, key=limits.api_key)
    if limits.allowed_origins:   # outermost: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    _install_error_handlers(app)

    def serving() -> OpenAIServing:
        if boot.serving is not None:
            return boot.serving
        if boot.error is not None:
            raise OpenAIError(f"the engine failed to start: {type(boot.error).__name__}: {boot.error}",
                              status=503, type="server_error")
        raise OpenAIError(f"the server is starting ({boot.stage}); retry once /ready answers 200",
                          status=503, type="server_error", code="not_ready",
                          headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the process answers and its engine is loading or running."""
        if boot.error is not None:
            return JSONResponse({"status": "engine failed to start", "error": str(boot.error)}, status_code=503)
        if not boot.alive:
            return JSONResponse({"status": boot.failure or "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok" if boot.ready else "starting"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the engine is warm and its thread runs (send traffic only then)."""
        if boot.ready:
            return JSONResponse({"status": "ready", "startup_seconds": boot.seconds})
        status = "failed" if boot.error is not None else "not running" if boot.serving else "starting"
        return JSONResponse({"status": status, "stage": boot.stage}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    def model_card() -> dict[str, Any]:
        eng = serving().engine
        return {"id": model_name, "object": "model", "created": created, "owned_by": "drafttree",
                "max_model_len": eng.max_model_len, "speculative": eng.spec.method}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve: the served model's card, a 404 for any other name."""
        if model != model_name:
            raise OpenAIError(f"The model '{model}' does not exist; this server serves '{model_name}'",
                              status=404, param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/engine")
    async def debug_engine() -> dict[str, int]:
        """Request counts as the engine thread last saw them (for tests and operators)."""
        w = boot.worker
        if w is None:
            return {"running": 0, "waiting": 0, "live": 0}
        return {"running": w.num_running, "waiting": w.num_waiting, "live": w.num_live}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Reply:
        return await serving().chat(req, raw)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, raw: Request) -> Reply:
        return await serving().completion(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return serving().tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        return serving().detokenize(req)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app


def serve_config(cfg: EngineConfig) -> EngineConfig:
    """The server's engine: with CUDA graphs, the constrained and processed rounds' graphs are
    captured after `/ready`, while idle (`EngineConfig.defer_graphs`), unless the flag says otherwise."""
    from drafttree.config import resolve_device
    if cfg.defer_graphs is None and cfg.cuda_graphs is not False and resolve_device(cfg.device).type == "cuda":
        return dataclasses.replace(cfg, defer_graphs=True)
    return cfg


def run_server(cfg: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               model_name: str | None = None, limits: ServerLimits | None = None) -> None:
    """Listen at once, build and warm the engine behind /ready, and serve until interrupted.
    An engine that fails to start, or loses a tensor-parallel rank, stops the server and raises
    its error here. Tensor-parallel: rank 0 serves; under torchrun the other ranks follow it."""
    import uvicorn

    from drafttree.loader.default_model import DEFAULT_MODEL_NAME

    cfg = serve_config(cfg)
    # a size the model or the host cannot take is refused before the server listens
    run = check_launch(cfg)
    if run is not None and run.rank != 0:   # a torchrun rank other than 0: the server is rank 0's
        follow(start_engine(cfg))
        return
    name = model_name or cfg.model or DEFAULT_MODEL_NAME
    server: uvicorn.Server | None = None

    def stop() -> None:   # a start-up thread or the engine thread: uvicorn ends, as on SIGTERM
        if server is not None:
            server.should_exit = True

    app = create_app(lambda: start_engine(cfg), name, limits, on_failure=stop)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    log.info("listening on http://%s:%d: /health answers now, /ready once the engine is loaded and warm%s",
             host, port, f" (tensor_parallel_size={cfg.tensor_parallel_size})" if cfg.tensor_parallel_size > 1 else "")
    boot: Boot = app.state.boot
    try:
        server.run()
    finally:
        boot.stop()
        if cfg.tensor_parallel_size > 1:
            boot.join()   # an engine still starting: its ranks are stopped once it is built
    if boot.error is not None:
        raise boot.error
    if boot.fatal is not None:
        raise TensorParallelError(boot.fatal)
