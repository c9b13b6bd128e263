"""A chat request's tools: the prompt (the chat template renders them; a template that ignores
them gets them described in a system message), the grammar that forces a call (tool_choice
"required" or a named function), and the reply's calls, whole or streamed as OpenAI streams them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from drafttree.server.protocol import ChatCompletionRequest, NamedToolChoice, OpenAIError
from drafttree.server.tool_parsers import CallDraft, ToolCall, ToolParser, call_id
from drafttree.structured.params import StructuredOutputs


@dataclass
class ToolPlan:
    """What a request's tools change: `tools` as the template takes them, the parser of the
    model's format, `forced` (a call is required: all tools, or the one named) and `parallel`."""
    tools: list[dict[str, Any]]
    parser: ToolParser
    forced: list[dict[str, Any]] | None
    parallel: bool
    named: bool

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: ToolParser) -> "ToolPlan | None":
        """None without tools or with tool_choice "none" (the tools are then not shown to the model)."""
        if not req.tools or req.tool_choice == "none":
            return None
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        choice = req.tool_choice
        parallel = req.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            forced = [t for t in tools if t["function"]["name"] == choice.function.name]
            return cls(tools, parser, forced, False, True)
        return cls(tools, parser, tools if choice == "required" else None, parallel, False)

    def structured(self) -> StructuredOutputs | None:
        if self.forced is None:
            return None
        return StructuredOutputs(grammar=self.parser.grammar(self.forced, self.parallel), name="tool call")

    def messages(self, messages: list[dict[str, Any]], renders_tools: bool) -> list[dict[str, Any]]:
        """The conversation as the template gets it: as is where the template renders `tools`,
        else with the tools described in the system message."""
        if renders_tools:
            return messages
        note = self.parser.describe(self.tools)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + note}] + messages[1:]
        return [{"role": "system", "content": note}] + messages

    def reply(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """(the message, its finish reason) of a whole reply (its text with the format's markers:
        `ToolParser.hidden_ids`): calls parsed out of it, else the text is the content."""
        content, calls = self.parser.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        if not self.parallel:
            calls = calls[:1]
        msg = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
        return msg, finish_reason if self.named or finish_reason != "stop" else "tool_calls"


def check_tools_and_format(req: ChatCompletionRequest, plan: ToolPlan | None,
                           structured: StructuredOutputs | None) -> None:
    if plan is not None and plan.forced is not None and structured is not None:
        raise OpenAIError("a forced tool call (tool_choice 'required' or a named function) cannot also take a "
                          "response_format or structured outputs: the call's arguments follow the function's "
                          "parameters", param="tool_choice")


@dataclass
class ToolStream:
    """A streamed reply's tool calls as OpenAI streams them: content until the calls begin, then
    each call's id, type and name once its head is written, and its arguments piece by piece as
    they grow (a call not in its format's usual form is sent whole at the end)."""
    plan: ToolPlan
    content_sent: int = 0
    sent: list[tuple[str, str]] = field(default_factory=list)   # per call begun: (name, arguments sent)

    def deltas(self, text: str, final: bool, hold: int = 0) -> list[dict[str, Any]]:
        """The chat deltas that text (the reply so far) adds; `final`: the reply is whole. While
        it grows, its last `hold` characters (what could still become a stop string) and an
        unfinished character wait, and so does whitespace that may come before a call."""
        parser = self.plan.parser
        at = parser.section_start(text)
        if final:
            calls: list[ToolCall | CallDraft] = list(parser.parse(text)[1])
            content_end = max(at, 0) if calls or self.sent else len(text)
        else:
            sure = text[:len(text) - hold].rstrip("\ufffd")
            content_end = parser.content_end(sure)
            while content_end > self.content_sent and sure[content_end - 1].isspace():
                content_end -= 1
            calls = parser.drafts(sure[at:]) if 0 <= at < len(sure) else []
        out: list[dict[str, Any]] = []
        if content_end > self.content_sent:
            piece = text[self.content_sent:content_end]
            if final and (calls or self.sent):
                piece = piece.rstrip()
            if piece:
                out.append({"content": piece})
            self.content_sent = content_end
        if not self.plan.parallel:
            calls = calls[:1]
        for i, c in enumerate(calls):
            args = c.arguments
            if i == len(self.sent):
                out.append({"tool_calls": [{"index": i, "id": c.id or call_id(), "type": "function",
                                            "function": {"name": c.name, "arguments": ""}}]})
                self.sent.append((c.name, ""))
            name, done = self.sent[i]
            # a call read differently once whole than while it grew (a malformed one) has had
            # what was sent: a stream cannot take a piece back
            if name == c.name and len(args) > len(done) and args.startswith(done):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[len(done):]}}]})
                self.sent[i] = (name, args)
        return out
