"""The OpenAI completion endpoints: prompt building, streaming with stop-string hold-back, usage."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from drafttree.loader.chat_template import apply_chat_template, has_chat_template
from drafttree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    OpenAIRequest,
    error_body,
    make_id,
    now,
)
from drafttree.server.limits import check_prompt_chars, max_chars_per_token
from drafttree.server.worker import BadRequest, EngineError, EngineWorker, RequestHandle, Snapshot, TokenBudget

DISCONNECT_POLL_S = 0.5
Reply = Response | dict[str, Any]


@dataclass
class _Call:
    """One request in flight, with what its response chunks need."""
    id: str
    chat: bool
    model: str
    created: int
    handle: RequestHandle
    include_usage: bool
    hold: int                       # characters held back while running (longest stop - 1)

    def usage(self, snap: Snapshot) -> dict[str, int]:
        p, c = self.handle.prompt_tokens, snap.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                               "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out


def spec_stats(snap: Snapshot, method: str) -> dict[str, Any]:
    return {"spec_method": method, "rounds": snap.rounds,
            "mean_accept_length": round(snap.mean_accept_length, 4)}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, worker: EngineWorker, model_name: str) -> None:
        self.worker = worker
        self.model_name = model_name
        self.engine = worker.engine
        tok = self.engine.tokenizer
        self.chars_per_token = max_chars_per_token(tok) if tok is not None else None

    def check_model(self, req: OpenAIRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(f"The model '{req.model}' does not exist; this server serves "
                              f"'{self.model_name}'", status=404, param="model", code="model_not_found")

    def chat_prompt(self, req: ChatCompletionRequest) -> str:
        tok = self.engine.tokenizer
        if not has_chat_template(tok):
            raise OpenAIError(f"the model '{self.model_name}' has no chat template: use /v1/completions",
                              param="messages")
        try:
            return apply_chat_template(tok, [m.template_dict() for m in req.messages])
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Reply:
        self.check_model(req)
        req.check()
        prompt = self.chat_prompt(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return await self._serve(req, prompt, TokenBudget(req.requested_max_tokens(), None, field), raw, chat=True)

    async def completion(self, req: CompletionRequest, raw: Request) -> Reply:
        self.check_model(req)
        req.check()
        prompt = req.single_prompt()
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise OpenAIError(f"the model '{self.model_name}' has no tokenizer: send token ids", param="prompt")
        # OpenAI's default for completions, clamped to what the context leaves
        return await self._serve(req, prompt, TokenBudget(req.max_tokens, 16), raw, chat=False)

    async def _serve(self, req: OpenAIRequest, prompt: str | list[int], budget: TokenBudget, raw: Request,
                     chat: bool) -> Reply:
        where = "messages" if chat else "prompt"
        if isinstance(prompt, str) and self.chars_per_token is not None:
            too_long = check_prompt_chars(prompt, self.engine.max_model_len, self.chars_per_token)
            if too_long is not None:   # refused before the engine thread spends time tokenizing it
                raise OpenAIError(too_long, param=where)
        params = req.sampling_params(budget.requested or 1)   # max_tokens: set once the prompt is tokenized
        rid = make_id("chatcmpl" if chat else "cmpl")
        try:
            handle = await self.worker.submit(rid, prompt, params, budget)
        except BadRequest as e:
            raise OpenAIError(str(e), param=e.param or where) from e
        except EngineError as e:
            raise OpenAIError(str(e), status=503, type="server_error") from e
        hold = max((len(s) for s in params.stop), default=1) - 1
        call = _Call(rid, chat, self.model_name, now(), handle, req.include_usage, hold)
        if req.stream:
            # The background abort covers a stream that never started (client gone before the first chunk).
            return StreamingResponse(self._stream(call, raw), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(handle.aclose))
        snap = await self._collect(handle, raw)
        if snap is None:   # the client left; nobody reads this
            return JSONResponse(error_body("client disconnected"), status_code=499)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": snap.text}, "logprobs": None,
                      "finish_reason": snap.finish_reason}
        else:
            choice = {"index": 0, "text": snap.text, "logprobs": None, "finish_reason": snap.finish_reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": call.created,
                "model": self.model_name, "choices": [choice], "usage": call.usage(snap),
                "drafttree": spec_stats(snap, self.engine.spec.method)}

    async def _collect(self, handle: RequestHandle, raw: Request) -> Snapshot | None:
        """Wait for the final snapshot, checking now and then that the client is still there."""
        loop = asyncio.get_running_loop()
        task: asyncio.Future[Snapshot] | None = None
        checked = loop.time()
        try:
            while True:
                task = task or asyncio.ensure_future(handle.next())
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    snap = task.result()
                    task = None
                    if snap.finished:
                        return snap
                if loop.time() - checked >= DISCONNECT_POLL_S:
                    checked = loop.time()
                    if await raw.is_disconnected():
                        return None
        except EngineError as e:
            raise OpenAIError(str(e), status=500, type="server_error") from e
        finally:
            if task is not None:
                task.cancel()
            handle.abort()

    async def _stream(self, call: _Call, raw: Request) -> AsyncIterator[str]:
        handle, emitted = call.handle, 0
        try:
            if call.chat:
                yield _sse(call.chunk("", None, role=True))
            while True:
                try:
                    snap = await handle.next()
                except EngineError as e:
                    yield _sse(error_body(str(e), type="server_error"))
                    break
                text = snap.text
                if snap.finished:
                    end = len(text)
                else:
                    # Hold back what could still become a stop string or an unfinished character.
                    end = len(text) - call.hold
                    while end > emitted and text[end - 1] == "\ufffd":
                        end -= 1
                if end > emitted:
                    yield _sse(call.chunk(text[emitted:end], None))
                    emitted = end
                if snap.finished:
                    last = call.chunk(None if call.chat else "", snap.finish_reason)
                    last["drafttree"] = spec_stats(snap, self.engine.spec.method)
                    yield _sse(last)
                    if call.include_usage:
                        yield _sse({"id": call.id, "object": last["object"], "created": call.created,
                                    "model": call.model, "choices": [], "usage": call.usage(snap)})
                    break
                if await raw.is_disconnected():
                    return
            yield "data: [DONE]\n\n"
        finally:
            # Runs on normal end, on cancellation by the server when the client leaves, and on close.
            handle.abort()
