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
from drafttree.server.tool_parsers import ToolParser, make_parser
from drafttree.server.tools import ToolPlan, ToolStream, check_tools_and_format
from drafttree.server.worker import BadRequest, EngineError, EngineWorker, RequestHandle, Snapshot, TokenBudget
from drafttree.structured.params import StructuredOutputs

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
    tools: ToolPlan | None = None   # a chat request with tools: calls parsed out of the reply

    def usage(self, snap: Snapshot) -> dict[str, int]:
        p, c = self.handle.prompt_tokens, snap.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False,
              delta: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
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


def _structured_param(req: OpenAIRequest) -> str:
    """The field a request gave its structured output in."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(req, name, None) is not None:
            return name
    return "response_format"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, worker: EngineWorker, model_name: str) -> None:
        self.worker = worker
        self.model_name = model_name
        self.engine = worker.engine
        tok = self.engine.tokenizer
        self.chars_per_token = max_chars_per_token(tok) if tok is not None else None
        self._tool_parser: ToolParser | None = None
        self._renders_tools: bool | None = None

    @property
    def tool_parser(self) -> ToolParser:
        """The model's tool-call format (`--tool-call-parser`, else its chat template's)."""
        if self._tool_parser is None:
            self._tool_parser = make_parser(self.engine.tokenizer, getattr(self.engine.cfg, "tool_call_parser", None))
        return self._tool_parser

    def renders_tools(self) -> bool:
        """Whether the chat template writes the tools it is given into the prompt."""
        if self._renders_tools is None:
            tok, probe = self.engine.tokenizer, [{"role": "user", "content": "x"}]
            tool = [{"type": "function", "function": {"name": "probe_tool_name", "parameters": {"type": "object"}}}]
            try:
                self._renders_tools = "probe_tool_name" in apply_chat_template(tok, probe, tools=tool)
            except ValueError:
                self._renders_tools = False
        return self._renders_tools
    def check_model(self, req: OpenAIRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(f"The model '{req.model}' does not exist; this server serves "
                              f"'{self.model_name}'", status=404, param="model", code="model_not_found")

    def chat_prompt(self, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> str:
        tok = self.engine.tokenizer
        if not has_chat_template(tok):
            raise OpenAIError(f"the model '{self.model_name}' has no chat template: use /v1/completions",
                              param="messages")
        messages = [m.template_dict() for m in req.messages]
        try:
            if tools is None:
                return apply_chat_template(tok, messages)
            if self.renders_tools():
                return apply_chat_template(tok, messages, tools=tools.tools)
            return apply_chat_template(tok, tools.messages(messages, False))
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Reply:
        self.check_model(req)
        req.check()
        structured = req.structured()
        tools = None
        if req.tools and req.tool_choice != "none":
            try:
                tools = ToolPlan.of(req, self.tool_parser)
            except ValueError as e:
                raise OpenAIError(str(e), param="tools") from e
        check_tools_and_format(req, tools, structured)
        if tools is not None and tools.forced is not None:
            structured = tools.structured()
        prompt = self.chat_prompt(req, tools)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return await self._serve(req, prompt, TokenBudget(req.requested_max_tokens(), None, field), raw, chat=True,
                                 structured=structured, tools=tools)

    async def completion(self, req: CompletionRequest, raw: Request) -> Reply:
        self.check_model(req)
        req.check()
        prompt = req.single_prompt()
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise OpenAIError(f"the model '{self.model_name}' has no tokenizer: send token ids", param="prompt")
        # OpenAI's default for completions, clamped to what the context leaves
        return await self._serve(req, prompt, TokenBudget(req.max_tokens, 16), raw, chat=False,
                                 structured=req.structured())

    def reply_text(self, snap: Snapshot) -> str:
        """A tool request's reply with its special tokens (a template's call markers may be
        special tokens, which the streamed text leaves out), ends of sequence aside."""
        eos = self.engine.eos_ids
        return self.engine.tokenizer.decode([t for t in snap.token_ids or () if t not in eos],
                                            skip_special_tokens=False)

    async def _serve(self, req: OpenAIRequest, prompt: str | list[int], budget: TokenBudget, raw: Request,
                     chat: bool, structured: StructuredOutputs | None = None, tools: ToolPlan | None = None) -> Reply:
        where = "messages" if chat else "prompt"
        if isinstance(prompt, str) and self.chars_per_token is not None:
            too_long = check_prompt_chars(prompt, self.engine.max_model_len, self.chars_per_token)
            if too_long is not None:   # refused before the engine thread spends time tokenizing it
                raise OpenAIError(too_long, param=where)
        params = req.sampling_params(budget.requested or 1, structured)   # max_tokens: set once the prompt is tokenized
        rid = make_id("chatcmpl" if chat else "cmpl")
        try:
            handle = await self.worker.submit(rid, prompt, params, budget, with_ids=tools is not None)
        except BadRequest as e:
            if str(e).startswith("structured outputs"):
                where = "tools" if tools is not None and tools.forced is not None else _structured_param(req)
            raise OpenAIError(str(e), param=e.param or where) from e
        except EngineError as e:
            raise OpenAIError(str(e), status=503, type="server_error") from e
        hold = max((len(s) for s in params.stop), default=1) - 1
        call = _Call(rid, chat, self.model_name, now(), handle, req.include_usage, hold, tools)
        if req.stream:
            # The background abort covers a stream that never started (client gone before the first chunk).
            return StreamingResponse(self._stream(call, raw), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(handle.aclose))
        snap = await self._collect(handle, raw)
        if snap is None:   # the client left; nobody reads this
            return JSONResponse(error_body("client disconnected"), status_code=499)
        if chat and tools is not None:
            message, finish = tools.reply(self.reply_text(snap), snap.finish_reason or "stop", snap.text)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        elif chat:
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
        tools_stream = ToolStream(call.tools) if call.tools is not None else None
        try:
            if call.chat:
                yield _sse(call.chunk("", None, role=True))
            while True:
                try:
                    snap = await handle.next()
                except EngineError as e:
                    yield _sse(error_body(str(e), type="server_error"))
                    break
                if call.tools is not None:
                    for delta in tools_stream.deltas(self.reply_text(snap), snap.finished):
                        yield _sse(call.chunk(None, None, delta=delta))
                    if snap.finished:
                        finish = call.tools.reply(self.reply_text(snap), snap.finish_reason or "stop")[1]
                        last = call.chunk(None, finish)
                        last["drafttree"] = spec_stats(snap, self.engine.spec.method)
                        yield _sse(last)
                        if call.include_usage:
                            yield _sse({"id": call.id, "object": last["object"], "created": call.created,
                                        "model": call.model, "choices": [], "usage": call.usage(snap)})
                        break
                    if await raw.is_disconnected():
                        return
                    continue
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
