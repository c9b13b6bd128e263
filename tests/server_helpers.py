"""The live server the server tests share: uvicorn on a free local port around an engine, and
the openai client for it."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.server.app import create_app

MODEL = "smollm2-test"
SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "drafttree" / "assets" / "drafter-smollm2"


@dataclass
class Live:
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def idle(self, timeout: float = 30.0) -> dict[str, int]:
        """Wait until the engine thread reports no request left; returns its last counts."""
        deadline = time.monotonic() + timeout
        while True:
            state = httpx.get(f"{self.url}/debug/engine").json()
            if not any(state.values()) or time.monotonic() > deadline:
                return state
            time.sleep(0.1)


@contextlib.contextmanager
def serve(engine: Engine | Callable[[], Engine], name: str = MODEL, wait_ready: bool = True,
          **app_kw: Any) -> Iterator[Live]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(engine, name, **app_kw), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    while wait_ready and httpx.get(f"{url}/ready").status_code != 200:   # warm-up runs behind /ready
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not get ready"
        time.sleep(0.05)
    try:
        yield Live(url)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def cpu_engine(model: str | Path, **kw: Any) -> Engine:
    return Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=4,
                               max_model_len=512, **kw))
