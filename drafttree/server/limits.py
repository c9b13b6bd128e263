"""Limits checked before any work: the API key (before anything is read), the request body's size
(before it is read), and a text prompt's length in characters (before it is tokenized)."""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from drafttree.server.protocol import error_body

DEFAULT_MAX_REQUEST_BYTES = 4 << 20


# what load balancers and monitors read without a key
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/debug/engine"})


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    api_key: str | None = None   # every request but OPEN_PATHS' carries `Authorization: Bearer <key>`
    allowed_origins: tuple[str, ...] = ("*",)   # browsers' cross-origin requests (CORS) from these; () none

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty (--api-key)")


class ApiKey:
    """ASGI middleware (vLLM's --api-key): a request without `Authorization: Bearer <key>` is
    answered 401 before the app reads it, but for the probes and metrics (OPEN_PATHS)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.want = app, b"Bearer " + key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.want):
                await _send_error(send, 401, error_body("a valid API key is needed: Authorization: Bearer <key>",
                                                        code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


async def _send_error(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
    """A JSON error answered by a middleware, before the app."""
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


def _too_large(limit: int) -> dict[str, Any]:
    return error_body(f"the request body is larger than this server's limit of {limit} bytes "
                      f"(--max-request-bytes)", code="request_too_large")


class BodySizeLimit:
    """ASGI middleware: a body over `limit` bytes is answered 413 before the app sees any of it.
    A declared Content-Length is checked before a byte is read; a chunked body is read up to the
    limit and refused as soon as it passes it, so no more than `limit` bytes are ever held."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = self.limit + 1
            if size > self.limit:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)   # the HTTP layer reads no more than declared
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":   # the client left
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(send)
                return
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # after the body: disconnects, as the app polls for them

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        await _send_error(send, 413, _too_large(self.limit), [(b"connection", b"close")])


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (its longest entry; a
    byte-level entry counts its bytes, at least its characters)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def check_prompt_chars(text: str, max_model_len: int, chars_per_token: int) -> str | None:
    """A message when `text` cannot fit the context whatever its tokens: each token stands for at
    most `chars_per_token` characters (doubled: a normalizer may expand text), so a longer text
    has more than max_model_len tokens. None when it may fit (the tokenizer then decides)."""
    bound = 2 * chars_per_token * max_model_len
    if len(text) <= bound:
        return None
    return (f"the prompt has {len(text)} characters, so more than {max_model_len} tokens (a token of this "
            f"model stands for at most {chars_per_token} characters); the context holds {max_model_len} tokens")
