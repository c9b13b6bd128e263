"""Tool calls in each chat-template family's own format: how a reply spells them (to parse it,
whole or while it streams) and the grammar that forces them (tool_choice "required" or a named
function), so that a forced call always parses and its arguments follow the function's schema.

- hermes: Hermes / Qwen2.5 / Qwen3 / ChatML models, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
- kimi_k2: Kimi K2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
  {...}<|tool_call_end|>...<|tool_calls_section_end|>`
- llama3_json: Llama 3.1+, `{"name": ..., "parameters": {...}}` (calls joined by "; ", after `<|python_tag|>` or not)
- deepseek_v3: DeepSeek-V3 / R1, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
- deepseek_v31: DeepSeek-V3.1, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
  <｜tool▁calls▁end｜>`
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import regex

from drafttree.engine.config import TOOL_CALL_PARSERS

PARSER_NAMES = TOOL_CALL_PARSERS
CLOSE_WINDOW = 64   # characters before a closing text's last one that its start is looked for in
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str     # JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallDraft:
    """A call of a growing reply as far as it is sure: its name, the id its format gives it (None:
    one is made), and its arguments' text so far, a prefix of the whole call's `arguments`."""
    name: str
    arguments: str
    id: str | None = None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _args_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


class ToolParser:
    """One family's format. `begin`: the text that opens the reply's tool calls; `markers`: every
    text the format writes around calls (kept in the reply's text where they are special tokens)."""
    name = ""
    begin = ""
    markers: tuple[str, ...] = ()
    # A growing reply's calls stream as they are written where the format has these: `opens`, what
    # opens each call; `_head`, a call from its opening to its arguments (the group `name`, and
    # `ident` where the format names the call); `_args_end`, what follows its arguments.
    # `closes`, the text every closing ends with ("": a call may close at the reply's end), and
    # `_close_first`, the characters a closing text starts with after its whitespace, keep the
    # search for it to the text's tail while the arguments grow.
    opens = ""
    _head: re.Pattern[str] | None = None
    _args_end: Any = None   # a `regex` pattern: matched partially at the text's end
    closes = ""
    _close_first = ""
    unclosed = False   # a last call the reply ends inside is read to the end

    def _ident(self, head: re.Match[str]) -> tuple[str | None, str | None]:
        """(name, id) of a call's head (name None: not readable)."""
        return head["name"], None

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._hidden: frozenset[int] | None = None

    def hidden_ids(self) -> frozenset[int]:
        """The special tokens a reply's text leaves out (as text decoded without special tokens
        does), all but this format's markers: the reply's text is then the plain text with the
        markers kept, the same whole and streamed."""
        if self._hidden is None:
            tok, keep = self.tokenizer, set(self.markers)
            ids = set(getattr(tok, "all_special_ids", None) or []) if tok is not None else set()
            decoder = getattr(tok, "added_tokens_decoder", None) or {}
            ids |= {i for i, t in decoder.items() if getattr(t, "special", False)}
            self._hidden = frozenset(i for i in ids if tok.convert_ids_to_tokens(i) not in keep)
        return self._hidden

    def literal(self, text: str) -> str:
        """`text` in a Lark grammar: the special token by id where the tokenizer has it as one
        (its bytes can never be spelled by other tokens), else a string."""
        tok = self.tokenizer
        if tok is not None:
            tid = tok.convert_tokens_to_ids(text)
            unk = getattr(tok, "unk_token_id", None)
            if isinstance(tid, int) and tid != unk and text in (tok.get_added_vocab() or {}):
                return f"<[{tid}]>"
        return json.dumps(text)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """Lark: one call of any of `tools` (several with `parallel`), then the end."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls, or None; the calls) of a whole reply: the calls read from
        where `begin` first stands; a reply with none readable is content whole."""
        at = text.find(self.begin)
        calls = self.calls(text[at:]) if at >= 0 else []
        if not calls:
            return (text or None), []
        return (text[:at].strip() or None), calls

    def calls(self, section: str) -> list[ToolCall]:
        """The calls readable in `section` (the reply from `begin` on), read as `drafts` reads
        them: at each opening, a head, then the arguments up to their closing text (a last call
        not closed: to the end, where the format is `unclosed`); a call not readable is skipped."""
        out: list[ToolCall] = []
        at = section.find(self.opens)
        while at >= 0:
            head = self._head.match(section, at)
            name, ident = self._ident(head) if head is not None else (None, None)
            close = self._close(section, head.end()) if name else None
            if close is None and name and self.unclosed:   # the rest is this call's
                out.append(ToolCall(ident or call_id(), name, section[head.end():].rstrip()))
                break
            if close is not None:
                out.append(ToolCall(ident or call_id(), name, section[head.end():close.start()]))
            at = section.find(self.opens, close.end() if close is not None else at + len(self.opens))
        return out

    def section_start(self, text: str) -> int:
        """Where a reply's calls begin (-1: not yet, or not at all)."""
        return text.find(self.begin)

    def drafts(self, section: str) -> list[CallDraft]:
        """The calls of a growing reply's `section` (from `begin` on) as far as they are sure, in
        order. A call's arguments are its JSON value once that is whole; before, the text up to
        where what could still close them starts. The calls stop at the first one that is not
        whole and closed yet, or not in the format's usual form (that one and those after it are
        read once the reply is whole); [] where the format has no `_head`."""
        out: list[CallDraft] = []
        if self._head is None:
            return out
        dec, at = json.JSONDecoder(), section.find(self.opens)
        while at >= 0:
            head = self._head.match(section, at)
            name, ident = self._ident(head) if head is not None else (None, None)
            if name is None:
                break
            try:
                end = dec.raw_decode(section, head.end())[1]
            except ValueError:   # not whole yet (or not JSON): up to what could close it
                out.append(CallDraft(name, section[head.end():self._open_end(section, head.end())], ident))
                break
            out.append(CallDraft(name, section[head.end():end], ident))
            close = self._args_end.match(section, end, partial=True)
            if close is None or close.partial:
                break
            at = section.find(self.opens, close.end())
        return out

    def _open_end(self, section: str, start: int) -> int:
        """Where arguments from `start` that are not a whole JSON value surely reach: to the first
        closing text, else to where one could still begin at the text's end, less the whitespace
        before it. A stream calls this once per step for each reply in a call: the search reads
        the tail, and the whole text only through `str.find`."""
        close = self._close(section, start)
        if close is not None:
            end = close.start()
        else:
            end = len(section)
            for k in range(max(start, end - CLOSE_WINDOW), end):
                if section[k] in self._close_first:
                    close = self._args_end.match(section, k, partial=True)
                    if close is not None and close.end() == len(section):
                        end = k
                        break
        while end > start and section[end - 1].isspace():
            end -= 1
        return end

    def _written(self, text: str, at: int, args: Any) -> str:
        """The arguments `args` of the JSON call object at `at` (whole, read) as the model wrote
        them where the head reads them (what a stream sends), else as JSON text."""
        head = self._head.match(text, at)
        if head is None:
            return _args_text(args)
        return text[head.end():json.JSONDecoder().raw_decode(text, head.end())[1]]

    def _close(self, section: str, start: int) -> Any:
        """The first closing text after arguments from `start` (a match; None: none yet): found
        by its last literal (`closes`), then matched in the window before it."""
        lit = section.find(self.closes, start) if self.closes else -1
        while lit >= 0:
            close = self._args_end.search(section, max(start, lit - CLOSE_WINDOW), lit + len(self.closes))
            if close is not None:
                return close
            lit = section.find(self.closes, lit + 1)
        return None

    def content_end(self, text: str) -> int:
        """How much of a growing reply is content for sure: up to where its calls begin, less a
        tail that could still become `begin`."""
        at = text.find(self.begin)
        if at >= 0:
            return at
        for k in range(min(len(self.begin) - 1, len(text)), 0, -1):
            if self.begin.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def describe(self, tools: list[dict[str, Any]]) -> str:
        """A system prompt naming the tools and this format, for chat templates that do not
        render tools themselves."""
        specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("Functions you can call, one JSON signature per line:\n" + specs +
                "\n\nTo call functions, reply with the calls alone, each written as:\n" + self.example())

    def example(self) -> str:
        raise NotImplementedError


def _json_string(text: str) -> str | None:
    """A JSON string literal's value (None: an escape JSON does not have)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _kimi_name(ident: str) -> str:
    """NAME of Kimi K2's call id `functions.NAME:IDX`."""
    return ident.split(":")[0].split(".", 1)[-1]


def _alternatives(rules: list[str]) -> str:
    return " | ".join(rules)


class HermesParser(ToolParser):
    name = "hermes"
    begin = opens = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")
    # the name first, then arguments written as a JSON object (not as a string of one)
    _head = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
    _args_end = regex.compile(r"\s*\}\s*</tool_call>")
    closes, _close_first = "</tool_call>", "}"

    def _ident(self, head: re.Match[str]) -> tuple[str | None, str | None]:
        return _json_string(head["name"]), None

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        lines = [f"start: call{more}",
                 f"call: {self.literal('<tool_call>')} \"\\n\" ({_alternatives([f'fn{i}' for i in range(len(tools))])}) "
                 f"\"\\n\" {self.literal('</tool_call>')}"]
        for i, t in enumerate(tools):
            head = json.dumps('{"name": ' + json.dumps(t["function"]["name"]) + ', "arguments": ')
            lines.append(f"fn{i}: {head} %json {json.dumps(_schema(t))} \"}}\"")
        return "\n".join(lines)

    def calls(self, section: str) -> list[ToolCall]:
        """Each call's JSON read as JSON (a string of its arguments may hold `</tool_call>`; what
        follows the object up to the next call is not read), its arguments as the model wrote them
        where they are an object after the name (what a stream sends), else as JSON text."""
        calls, dec = [], json.JSONDecoder()
        at = section.find(self.opens)
        while at >= 0:
            start = _SPACE.match(section, at + len(self.opens)).end()
            try:
                obj, end = dec.raw_decode(section, start)
            except ValueError:
                obj, end = None, start
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                at = section.find(self.opens, start)
                continue
            calls.append(ToolCall(call_id(), obj["name"], self._written(section, at, obj.get("arguments", {}))))
            at = section.find(self.opens, end)
        return calls

    def example(self) -> str:
        return '<tool_call>\n{"name": "NAME", "arguments": {ARGUMENTS}}\n</tool_call>'


class KimiK2Parser(ToolParser):
    name = "kimi_k2"
    begin = "<|tool_calls_section_begin|>"
    opens = "<|tool_call_begin|>"
    markers = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
               "<|tool_call_end|>", "<|tool_calls_section_end|>")
    _head = re.compile(r"<\|tool_call_begin\|>\s*(?P<ident>[^<\s]+)\s*<\|tool_call_argument_begin\|>\s*")
    _args_end = regex.compile(r"\s*<\|tool_call_end\|>")
    closes, _close_first, unclosed = "<|tool_call_end|>", "<", True

    def _ident(self, head: re.Match[str]) -> tuple[str | None, str | None]:
        return _kimi_name(head["ident"]), head["ident"]

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        L = self.literal
        lines = [f"start: {L('<|tool_calls_section_begin|>')} call{'+' if parallel else ''} "
                 f"{L('<|tool_calls_section_end|>')}",
                 f"call: {L('<|tool_call_begin|>')} ({_alternatives([f'fn{i}' for i in range(len(tools))])}) "
                 f"{L('<|tool_call_end|>')}"]
        for i, t in enumerate(tools):
            head = json.dumps("functions." + t["function"]["name"] + ":")
            lines.append(f"fn{i}: {head} /[0-9]+/ {L('<|tool_call_argument_begin|>')} %json {json.dumps(_schema(t))}")
        return "\n".join(lines)

    def example(self) -> str:
        return ("<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>"
                "{ARGUMENTS}<|tool_call_end|><|tool_calls_section_end|>")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    begin = "<|python_tag|>"
    markers = ("<|python_tag|>",)
    opens = "{"
    _head = re.compile(r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)')
    _args_end = regex.compile(r"\s*\}\s*(?:;|$)")
    _close_first = "}"

    def _ident(self, head: re.Match[str]) -> tuple[str | None, str | None]:
        return _json_string(head["name"]), None

    def section_start(self, text: str) -> int:
        """A reply whose first text is the tag or a JSON object is read as calls (whole, they must
        be calls alone)."""
        body = text.lstrip()
        return len(text) - len(body) if body.startswith((self.begin, "{")) else -1

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        lines = [f"start: call{more}",
                 f"call: {_alternatives([f'fn{i}' for i in range(len(tools))])}"]
        for i, t in enumerate(tools):
            head = json.dumps('{"name": ' + json.dumps(t["function"]["name"]) + ', "parameters": ')
            lines.append(f"fn{i}: {head} %json {json.dumps(_schema(t))} \"}}\"")
        return "\n".join(lines)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.begin):
            body = body[len(self.begin):].strip()
        if not body.startswith("{"):
            return (text or None), []
        calls, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, end = dec.raw_decode(body, i)
            except ValueError:
                break
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                break
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(ToolCall(call_id(), obj["name"], self._written(body, i, args)))
            i = end
            while i < len(body) and body[i] in " ;\n":
                i += 1
        if not calls or i < len(body):
            return (text or None), []
        return None, calls

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self.begin.startswith(stripped[:len(self.begin)]):
            return 0   # a reply that may be a call: held until it is parsed whole
        return len(text)

    def example(self) -> str:
        return '{"name": "NAME", "parameters": {ARGUMENTS}}'


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    begin = "<｜tool▁calls▁begin｜>"
    opens = "<｜tool▁call▁begin｜>"
    markers = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁calls▁end｜>")
    _head = re.compile(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*(?P<name>[^\n<]+?)\s*```json\s*")
    _args_end = regex.compile(r"\s*```\s*<｜tool▁call▁end｜>")
    closes, _close_first = "<｜tool▁call▁end｜>", "`"

    def _ident(self, head: re.Match[str]) -> tuple[str | None, str | None]:
        return head["name"].strip(), None

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        L = self.literal
        more = ' ("\\n"? call)*' if parallel else ""
        lines = [f"start: {L(self.markers[0])} call{more} {L(self.markers[4])}",
                 f"call: {L(self.markers[1])} \"function\" {L(self.markers[2])} "
                 f"({_alternatives([f'fn{i}' for i in range(len(tools))])}) {L(self.markers[3])}"]
        for i, t in enumerate(tools):
            head = json.dumps(t["function"]["name"] + "\n```json\n")
            lines.append(f"fn{i}: {head} %json {json.dumps(_schema(t))} \"\\n```\"")
        return "\n".join(lines)

    def example(self) -> str:
        return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{ARGUMENTS}\n```"
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    _head = re.compile(r"<｜tool▁call▁begin｜>\s*(?P<name>[^<]+?)\s*<｜tool▁sep｜>\s*")
    _args_end = regex.compile(r"\s*<｜tool▁call▁end｜>")
    _close_first = "<"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        L = self.literal
        lines = [f"start: {L(self.markers[0])} call{'+' if parallel else ''} {L(self.markers[4])}",
                 f"call: {L(self.markers[1])} ({_alternatives([f'fn{i}' for i in range(len(tools))])}) "
                 f"{L(self.markers[3])}"]
        for i, t in enumerate(tools):
            lines.append(f"fn{i}: {json.dumps(t['function']['name'])} {L(self.markers[2])} %json {json.dumps(_schema(t))}")
        return "\n".join(lines)

    def example(self) -> str:
        return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGUMENTS}<｜tool▁call▁end｜>"
                "<｜tool▁calls▁end｜>")


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, KimiK2Parser, Llama3JsonParser,
                                                             DeepSeekV3Parser, DeepSeekV31Parser)}


def detect(chat_template: str | None) -> str:
    """The parser for a chat template: by the markers it writes; Hermes's otherwise (ChatML)."""
    t = chat_template or ""
    if "<|tool_calls_section_begin|>" in t or "<|tool_call_begin|>" in t:
        return "kimi_k2"
    if "<｜tool▁call▁begin｜>" in t:   # V3 wraps the arguments in a json block, V3.1 writes them bare
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "parameters" in t):
        return "llama3_json"
    return "hermes"


def make_parser(tokenizer: Any, name: str | None = None) -> ToolParser:
    """The parser `name` (a `--tool-call-parser`), else the one the model's chat template writes."""
    if name is None:
        name = detect(getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}")
    return PARSERS[name](tokenizer)
