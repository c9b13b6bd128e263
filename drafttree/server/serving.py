"""The OpenAI completion endpoints: prompt building, streaming with stop-string hold-back, usage."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from drafttree.loader.chat_template import TemplateOptionError, apply_chat_template, has_chat_template
from drafttree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    OpenAIRequest,
    TokenizeRequest,
    error_body,
    make_id,
    now,
)
from drafttree.server.limits import check_prompt_chars, max_chars_per_token
from drafttree.server.logprobs import CompletionLogprobs, TokenTexts, chat_content, prompt_logprobs
from drafttree.server.reasoning import ReasoningStream, reasoning_fields
from drafttree.server.tool_parsers import ToolParser, make_parser
from drafttree.server.tools import ToolPlan, ToolStream, check_tools_and_format
from drafttree.server.worker import (
    BadRequest,
    ChoiceSnapshot,
    EngineError,
    EngineWorker,
    RequestHandle,
    Snapshot,
    TokenBudget,
)
from drafttree.structured.params import StructuredOutputs
from drafttree.structured.reasoning import GrowingText, PartsReader, Reasoning, cut_at_stops

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
    stop: tuple[str, ...] = ()      # the request's stop strings
    tools: ToolPlan | None = None   # a chat request with tools: calls parsed out of the reply
    logprobs: int | None = None     # the most likely tokens per token, where log-probabilities are asked
    echo: str | None = None         # completions' echo: the prompt's text, which each choice's text begins with
    prompt_logprobs: bool = False   # vLLM's prompt_logprobs asked: the response carries them
    n: int = 1                      # choices
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    reasoning: str | None = None    # with a reasoning parser: where the prompt left the reasoning (`Reasoning.state`)
    include_reasoning: bool = True  # the reply carries the reasoning (vLLM's include_reasoning)
    last: Snapshot | None = None    # streamed: the final snapshot, once the request finished
    failed: bool = False            # streamed: the engine failed the request (an error chunk went out)

    def usage(self, snap: Snapshot | None, reasoning_tokens: int | None = None) -> dict[str, Any]:
        """OpenAI's usage; with a reasoning parser, the completion's reasoning tokens among its
        details, as OpenAI counts them."""
        p, c = self.handle.prompt_tokens, 0 if snap is None else snap.completion_tokens
        out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if reasoning_tokens is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The stream's last chunk before [DONE] where the usage is asked (stream_options.include_usage)."""
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False,
              delta: dict[str, Any] | None = None, index: int = 0, logprobs: Any = None,
              stop_reason: int | str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        if finish_reason is not None:   # vLLM's: the stop string or token id that ended the choice
            choice["stop_reason"] = stop_reason
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                               "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out


@dataclass
class _Streamed:
    """What a streamed choice has sent: characters of its text, tokens' log-probabilities, its
    tool calls, its end."""
    emitted: int = 0
    tokens: int = 0
    done: bool = False
    tools: ToolStream | None = None
    offsets: CompletionLogprobs | None = None
    reasoning: ReasoningStream | None = None
    tool_text: GrowingText | None = None   # a tool request's text so far (`reply_text`)


def spec_stats(method: str, *snaps: Snapshot) -> dict[str, Any]:
    """The speculation's statistics of a request (of a batch's requests together)."""
    rounds = sum(s.rounds for s in snaps)
    accepted = sum(s.mean_accept_length * s.rounds for s in snaps)
    return {"spec_method": method, "rounds": rounds,
            "mean_accept_length": round(accepted / rounds, 4) if rounds else 0.0}


def _text_ids(c: ChoiceSnapshot) -> Sequence[int]:
    """The ids a tool or reasoning reply is decoded from: the choice's, less the stop token id that
    ended it (`stop_reason`), which the engine's text leaves out too (those replies refuse
    include_stop_str_in_output)."""
    ids = c.token_ids or ()
    return ids[:-1] if isinstance(c.stop_reason, int) else ids


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
        self.token_texts = TokenTexts(tok)

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

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest, tools: ToolPlan | None = None) -> str:
        tok = self.engine.tokenizer
        if not has_chat_template(tok):
            raise OpenAIError(f"the model '{self.model_name}' has no chat template: use /v1/completions",
                              param="messages")
        messages = [m.template_dict() for m in req.messages]
        kw = req.template_options()
        try:
            if tools is None:
                return apply_chat_template(tok, messages, **kw)
            if self.renders_tools():
                return apply_chat_template(tok, messages, tools=tools.tools, **kw)
            return apply_chat_template(tok, tools.messages(messages, False), **kw)
        except TemplateOptionError as e:
            raise OpenAIError(str(e), param=e.param) from e
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids the engine is given for this prompt text (tokenized as
        completions tokenize it) or these messages (rendered as chat renders them)."""
        self.check_model(req)
        req.check()
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(f"the model '{self.model_name}' has no tokenizer", param="prompt")
        if req.messages is not None:
            try:
                tools = ToolPlan.of(req, self.tool_parser)
            except ValueError as e:
                raise OpenAIError(str(e), param="tools") from e
            text = self.chat_prompt(req, tools)
        else:
            text = req.prompt
        ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, str]:
        """vLLM's /detokenize: the text of token ids (special tokens kept)."""
        self.check_model(req)
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(f"the model '{self.model_name}' has no tokenizer", param="tokens")
        vocab = self.engine.model_cfg.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise OpenAIError(f"token ids {bad[:5]} outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

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
                                 structured=structured, tools=tools, include_reasoning=req.include_reasoning)

    async def completion(self, req: CompletionRequest, raw: Request) -> Reply:
        self.check_model(req)
        req.check()
        prompts = req.prompt_list()
        if any(isinstance(p, str) for p in prompts) and self.engine.tokenizer is None:
            raise OpenAIError(f"the model '{self.model_name}' has no tokenizer: send token ids", param="prompt")
        if len(prompts) > 1:
            return await self._serve_batch(req, prompts, raw)
        # OpenAI's default for completions, clamped to what the context leaves
        return await self._serve(req, prompts[0], TokenBudget(req.max_tokens, 16), raw, chat=False,
                                 structured=req.structured())

    @property
    def reasoning(self) -> Reasoning | None:
        """The model's reasoning format (`--reasoning-parser`), or None."""
        return self.engine.text.reasoning

    def _usage(self, call: _Call, snap: Snapshot) -> dict[str, Any]:
        if call.reasoning is None:
            return call.usage(snap)
        count = self.reasoning.reasoning_tokens
        return call.usage(snap, sum(count(c.token_ids or (), call.reasoning) for c in snap.choices))

    def parts_reader(self, call: _Call) -> PartsReader | None:
        """What reads a reasoning model's reply in its parts; None without a parser and for
        completions."""
        if call.reasoning is None:
            return None
        return PartsReader(self.engine.tokenizer, self.reasoning, call.reasoning, self.engine.eos_ids,
                           marked_without=None if call.tools is None else call.tools.parser.hidden_ids())

    def reply_text(self, call: _Call, choice: ChoiceSnapshot, growing: GrowingText | None = None) -> str:
        """A tool request's reply with its format's markers (which may be special tokens, which
        `choice.text` leaves out) and no other special token, cut before the stop string that ended
        it (the engine cut `choice.text` there); `growing`: a stream's text so far, decoded a window
        at a time."""
        hidden = self.engine.eos_ids | call.tools.parser.hidden_ids()
        ids = [t for t in _text_ids(choice) if t not in hidden]
        growing = growing or GrowingText(self.engine.tokenizer, False)
        text = growing.update(ids, choice.finished)
        return cut_at_stops(text, call.stop) if choice.finish_reason == "stop" else text

    def echoed(self, req: OpenAIRequest, prompt: str | list[int]) -> str | None:
        """The text a completions request's choices begin with (echo), else None."""
        if not isinstance(req, CompletionRequest) or not req.echo:
            return None
        if isinstance(prompt, str):
            return prompt
        tok = self.engine.tokenizer
        return "" if tok is None else tok.decode(prompt)

    async def _serve(self, req: OpenAIRequest, prompt: str | list[int], budget: TokenBudget, raw: Request,
                     chat: bool, structured: StructuredOutputs | None = None, tools: ToolPlan | None = None,
                     include_reasoning: bool = True) -> Reply:
        call = await self._start(req, prompt, budget, chat, structured, tools, include_reasoning)
        handle, rid = call.handle, call.id
        if req.stream:
            # The background abort covers a stream that never started (client gone before the first chunk).
            return StreamingResponse(self._stream(call, raw), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(handle.aclose))
        snap = await self._collect(handle, raw)
        if snap is None:   # the client left; nobody reads this
            return JSONResponse(error_body("client disconnected"), status_code=499)
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": call.created,
               "model": self.model_name, "choices": [self._choice(call, c, snap) for c in snap.choices],
               "usage": self._usage(call, snap), "drafttree": spec_stats(self.engine.spec.method, snap)}
        if chat and call.prompt_logprobs:   # vLLM's chat answers them beside the choices
            out["prompt_logprobs"] = self._prompt_logprobs(call, snap)
        return out

    async def _serve_batch(self, req: CompletionRequest, prompts: list[str | list[int]], raw: Request) -> Reply:
        """Completions of several prompts in one request, as vLLM answers them: each prompt its own
        engine request, prompt i's choice j at index i * n + j, the usage summed."""
        rid, created, calls, structured = make_id("cmpl"), now(), [], req.structured()
        try:
            for p in prompts:
                calls.append(await self._start(req, p, TokenBudget(req.max_tokens, 16), False, structured))
                calls[-1].id, calls[-1].created = rid, created
        except BaseException:
            for c in calls:
                c.handle.abort()
            raise
        if req.stream:
            async def abort_all() -> None:
                for c in calls:
                    await c.handle.aclose()
            return StreamingResponse(self._stream_batch(calls, raw), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(abort_all))
        try:
            snaps = await asyncio.gather(*(self._collect(c.handle, raw) for c in calls))
        finally:
            for c in calls:
                c.handle.abort()
        if any(s is None for s in snaps):
            return JSONResponse(error_body("client disconnected"), status_code=499)
        choices = []
        for i, (call, snap) in enumerate(zip(calls, snaps)):
            for c in snap.choices:
                choices.append({**self._choice(call, c, snap), "index": i * call.n + c.index})
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": _summed([c.usage(s) for c, s in zip(calls, snaps)]),
                "drafttree": spec_stats(self.engine.spec.method, *snaps)}

    async def _start(self, req: OpenAIRequest, prompt: str | list[int], budget: TokenBudget, chat: bool,
                     structured: StructuredOutputs | None = None, tools: ToolPlan | None = None,
                     include_reasoning: bool = True) -> _Call:
        """The request submitted to the engine, refused with a 400 naming what is wrong."""
        where = "messages" if chat else "prompt"
        if isinstance(prompt, str) and self.chars_per_token is not None and req.truncate_prompt_tokens is None:
            too_long = check_prompt_chars(prompt, self.engine.max_model_len, self.chars_per_token)
            if too_long is not None:   # refused before the engine thread spends time tokenizing it
                raise OpenAIError(too_long, param=where)
        # max_tokens is set once the prompt is tokenized; until then the most it may come to
        params = req.sampling_params(budget.requested or budget.default or self.engine.max_model_len, structured,
                                     self.engine.sampling_defaults)
        rid = make_id("chatcmpl" if chat else "cmpl")
        reasons = chat and self.reasoning is not None
        if tools is not None or reasons:   # those replies are decoded again from their tokens, as parsed
            for name, default in (("include_stop_str_in_output", False), ("skip_special_tokens", True),
                                  ("spaces_between_special_tokens", True)):
                if getattr(params, name) != default:
                    raise OpenAIError(f"{name}={getattr(params, name)} is not supported "
                                      f"{'with tools' if tools is not None else 'under a reasoning parser'} "
                                      "(the reply's text is parsed from its tokens)", param=name)
        try:
            handle = await self.worker.submit(rid, prompt, params, budget, with_ids=tools is not None or reasons)
        except BadRequest as e:
            if str(e).startswith("structured outputs"):
                where = "tools" if tools is not None and tools.forced is not None else _structured_param(req)
            raise OpenAIError(str(e), param=e.param or where) from e
        except EngineError as e:
            raise OpenAIError(str(e), status=503, type="server_error") from e
        hold = max((len(s) for s in params.stop), default=1) - 1
        return _Call(rid, chat, self.model_name, now(), handle, req.include_usage, hold, tuple(params.stop), tools,
                     params.logprobs, self.echoed(req, prompt), req.prompt_logprobs is not None, params.n,
                     req.continuous_usage, self.reasoning.state(handle.prompt_ids) if reasons else None,
                     include_reasoning)

    def _prompt_logprobs(self, call: _Call, snap: Snapshot) -> list | None:
        if snap.prompt_logprobs is None:
            return None
        return prompt_logprobs(call.handle.prompt_ids, snap.prompt_logprobs, self.token_texts)

    def _choice(self, call: _Call, c: ChoiceSnapshot, snap: Snapshot) -> dict[str, Any]:
        """One choice of a whole (non-streamed) response."""
        if call.chat:
            reader = self.parts_reader(call)
            parts = None if reader is None else reader.read(_text_ids(c), call.stop, c.finish_reason)
            if call.tools is not None:
                message, finish = call.tools.reply(self.reply_text(call, c) if parts is None else parts.marked,
                                                   c.finish_reason or "stop")
            else:
                content = c.text if parts is None else parts.content or None
                message, finish = {"role": "assistant", "content": content}, c.finish_reason
            if parts is not None and parts.reasoning and call.include_reasoning:   # as the stream sends it
                message.update(reasoning_fields(parts.reasoning))
            lps = None
            if call.logprobs is not None:
                lps = {"content": chat_content(list(c.token_ids), list(c.logprobs), call.logprobs, self.token_texts)}
            return {"index": c.index, "message": message, "logprobs": lps, "finish_reason": finish,
                    "stop_reason": c.stop_reason}
        out: dict[str, Any] = {"index": c.index, "text": (call.echo or "") + c.text, "logprobs": None,
                               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if call.logprobs is not None:
            lps = CompletionLogprobs(call.logprobs, self.token_texts)
            out["logprobs"] = self._echo_logprobs(call, snap, lps) or lps.piece([], [])
            more = lps.piece(list(c.token_ids), list(c.logprobs))
            for k, v in more.items():
                out["logprobs"][k] += v
        if call.prompt_logprobs:
            out["prompt_logprobs"] = self._prompt_logprobs(call, snap)
        return out

    def _echo_logprobs(self, call: _Call, snap: Snapshot, lps: CompletionLogprobs) -> dict[str, Any] | None:
        """With echo, the prompt's part of completions' logprobs (its first token's None)."""
        if call.echo is None or snap.prompt_logprobs is None:
            return None
        prompt = list(call.handle.prompt_ids)
        return lps.piece(prompt, [None, *snap.prompt_logprobs])

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

    def _stream_logprobs(self, call: _Call, c: ChoiceSnapshot, st: _Streamed) -> Any:
        """The log-probabilities of the tokens a choice has not sent yet (None where not asked)."""
        if call.logprobs is None:
            return None
        new = list(c.token_ids[st.tokens:]), list(c.logprobs[st.tokens:])
        st.tokens = len(c.token_ids)
        if call.chat:
            return {"content": chat_content(*new, call.logprobs, self.token_texts)}
        return st.offsets.piece(*new)

    def _choice_chunks(self, call: _Call, c: ChoiceSnapshot, st: _Streamed, snap: Snapshot) -> list[dict[str, Any]]:
        """The chunks a choice's progress adds; the last one once it finishes."""
        out = []
        text, parts = c.text, None
        if st.reasoning is not None:
            parts = st.reasoning.reader.read(_text_ids(c), call.stop, c.finish_reason)
        if parts is not None:
            for delta in st.reasoning.deltas(parts, c.finished, call.hold):
                if call.include_reasoning:
                    out.append(call.chunk(None, None, delta=delta, index=c.index,
                                          logprobs=self._stream_logprobs(call, c, st)))
            text = parts.content
        if call.tools is not None:
            text = self.reply_text(call, c, st.tool_text) if parts is None else parts.marked
            for delta in st.tools.deltas(text, c.finished, call.hold):
                out.append(call.chunk(None, None, delta=delta, index=c.index))
            if c.finished:
                finish = call.tools.reply(text, c.finish_reason or "stop")[1]
                out.append(call.chunk(None, finish, index=c.index, logprobs=self._stream_logprobs(call, c, st),
                                      stop_reason=c.stop_reason))
            return out
        if c.finished:
            end = len(text)
        else:
            # Hold back what could still become a stop string or an unfinished character.
            end = len(text) - call.hold
            while end > st.emitted and text[end - 1] == "\ufffd":
                end -= 1
        if end > st.emitted:
            out.append(call.chunk(text[st.emitted:end], None, index=c.index,
                                  logprobs=self._stream_logprobs(call, c, st)))
            st.emitted = end
        if c.finished:
            lps = self._stream_logprobs(call, c, st) if call.logprobs is not None and st.tokens < len(c.token_ids) \
                else None
            out.append(call.chunk(None if call.chat else "", c.finish_reason, index=c.index, logprobs=lps,
                                  stop_reason=c.stop_reason))
        return out

    async def _stream(self, call: _Call, raw: Request) -> AsyncIterator[str]:
        try:
            if call.chat:
                for i in range(call.n):
                    first = call.chunk("", None, role=True, index=i)
                    if call.continuous_usage:
                        first["usage"] = call.usage(None)
                    yield _sse(first)
            async for chunk in self._chunks(call, raw):
                yield _sse(chunk)
            if call.last is None and not call.failed:   # the client left
                return
            if call.last is not None and call.include_usage:
                yield _sse(call.usage_chunk(self._usage(call, call.last)))
            yield "data: [DONE]\n\n"
        finally:
            # Runs on normal end, on cancellation by the server when the client leaves, and on close.
            call.handle.abort()

    async def _stream_batch(self, calls: list[_Call], raw: Request) -> AsyncIterator[str]:
        """A batch's streams merged as their chunks come (each prompt's choices at their batch
        index), then the summed usage and one [DONE]."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def pump(i: int, call: _Call) -> None:
            try:
                async for chunk in self._chunks(call, raw, i * call.n):
                    await queue.put(chunk)
            finally:
                await queue.put(None)
        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(calls)]
        try:
            left = len(tasks)
            while left:
                chunk = await queue.get()
                if chunk is None:
                    left -= 1
                else:
                    yield _sse(chunk)
            if any(c.last is None and not c.failed for c in calls):   # the client left
                return
            if calls[0].include_usage and all(c.last is not None for c in calls):
                yield _sse(calls[0].usage_chunk(_summed([c.usage(c.last) for c in calls])))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for c in calls:
                c.handle.abort()

    async def _chunks(self, call: _Call, raw: Request, offset: int = 0) -> AsyncIterator[dict[str, Any]]:
        """A request's stream chunks as its snapshots come, choice indices moved by `offset` (a
        batch's later prompts); its final snapshot left in `call.last`. An engine error is one
        error chunk (`call.failed`); a client that leaves ends it early."""
        handle = call.handle
        streams = {i: _Streamed(tools=ToolStream(call.tools) if call.tools else None,
                                offsets=None if call.chat or call.logprobs is None
                                else CompletionLogprobs(call.logprobs, self.token_texts),
                                reasoning=None if call.reasoning is None else ReasoningStream(self.parts_reader(call)),
                                tool_text=GrowingText(self.engine.tokenizer, False) if call.tools else None)
                   for i in range(call.n)}
        echoed = False
        try:
            while True:
                try:
                    snap = await handle.next()
                except EngineError as e:
                    call.failed = True
                    yield error_body(str(e), type="server_error")
                    return
                chunks: list[dict[str, Any]] = []
                for c in snap.choices:
                    st = streams[c.index]
                    if call.echo is not None and not echoed:   # each choice's first chunk: the prompt
                        chunks.append(call.chunk(call.echo, None, index=c.index, logprobs=st.offsets and
                                                 self._echo_logprobs(call, snap, st.offsets)))
                    if not st.done:
                        chunks += self._choice_chunks(call, c, st, snap)
                        st.done = c.finished
                echoed = True
                if snap.finished and chunks:   # the request's last chunk carries the speculation's statistics
                    chunks[-1]["drafttree"] = spec_stats(self.engine.spec.method, snap)
                usage = self._usage(call, snap) if call.continuous_usage else None
                for chunk in chunks:
                    if usage is not None:
                        chunk["usage"] = usage
                    for choice in chunk["choices"]:
                        choice["index"] += offset
                    yield chunk
                if snap.finished:
                    call.last = snap
                    return
                if await raw.is_disconnected():
                    return
        finally:
            handle.abort()


def _summed(usages: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
