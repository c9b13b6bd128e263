"""A reasoning model's reply, `<think>` reasoning `</think>` answer: which part of the output is
reasoning and which the answer (the server's `reasoning_content` and `content`; their text,
`reply_parts`), and where the answer's constraint begins (`AfterReasoning`).

Whether the output begins inside the reasoning is read off the prompt (`Reasoning.state`), not
assumed per family: a chat template that opens the reasoning itself (DeepSeek-R1's, Qwen3 thinking
2507's) ends the prompt inside `<think>` ("open"); one that turns it off (Qwen3's
`enable_thinking: false`, DeepSeek-V3.1's non-thinking mode) ends it with `</think>` ("closed": the
output is the answer); otherwise ("free") the model may open it with `<think>` as its first token,
and an output that does not is the answer alone. The markers must be single tokens of the
vocabulary."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from drafttree.structured.params import AfterReasoning


@dataclass(frozen=True)
class ReasoningFormat:
    """How a family marks its reasoning. `answer_starts`: markers that end the reasoning without
    its end marker and belong to the answer (Kimi K2 may begin its tool calls so)."""
    name: str
    start: str = "<think>"
    end: str = "</think>"
    answer_starts: tuple[str, ...] = ()


# vLLM's `--reasoning-parser` names for the families drafttree serves
FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("deepseek_r1"),
    ReasoningFormat("deepseek_v3"),
    ReasoningFormat("qwen3"),
    ReasoningFormat("kimi_k2", answer_starts=("<|tool_calls_section_begin|>",)),
)}


PromptState = Literal["open", "closed", "free"]


def _index(ids: list[int], token: int, start: int) -> int:
    try:
        return ids.index(token, start)
    except ValueError:
        return len(ids)


@dataclass(frozen=True)
class Split:
    """An output's token ids in two parts. `reasoning`: None where the output holds none; `ended`:
    the reasoning has ended (the answer has begun, perhaps empty)."""
    reasoning: Sequence[int] | None
    answer: Sequence[int]
    ended: bool


def _single_token(tokenizer: Any, text: str, parser: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"reasoning parser {parser}: the model's tokenizer spells {text!r} as {len(ids)} tokens "
                         f"{ids[:4]}, not one; this model does not write {parser}'s reasoning")
    return ids[0]


class Reasoning:
    """A reasoning format over one tokenizer: its markers' token ids."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        if name not in FORMATS:
            raise ValueError(f"unknown reasoning parser {name!r}: choose one of {', '.join(FORMATS)}")
        if tokenizer is None:
            raise ValueError(f"reasoning parser {name}: the model has no tokenizer")
        self.format = f = FORMATS[name]
        self.tokenizer = tokenizer
        self.start_id = _single_token(tokenizer, f.start, name)
        self.end_id = _single_token(tokenizer, f.end, name)
        self.answer_start_ids = frozenset(_single_token(tokenizer, m, name) for m in f.answer_starts)

    def state(self, prompt: str | Sequence[int]) -> PromptState:
        """Where the prompt (its text or token ids) leaves the reasoning, read from its end: "open"
        where the last marker is the start, "closed" where it is the end with only whitespace
        after it, else "free"."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == self.start_id:
                return "open"
            if ids[i] == self.end_id:
                return "closed" if not self.tokenizer.decode(list(ids[i + 1:])).strip() else "free"
        return "free"

    def split(self, ids: Sequence[int], state: PromptState) -> Split:
        """The output's reasoning (its markers left out) and answer, after a prompt in `state`.
        Where the prompt left it free, the reasoning must begin at the output's first token."""
        ids = list(ids)
        first = 0
        if state == "closed":
            return Split(None, ids, bool(ids))
        if state == "free":
            if not ids or ids[0] != self.start_id:
                return Split(None, ids, bool(ids))
            first = 1
        at = [_index(ids, m, first) for m in (self.end_id, *self.answer_start_ids)]
        end = min(at)
        if end == len(ids):
            return Split(ids[first:], [], False)
        return Split(ids[first:end], ids[end + (end == at[0]):], True)   # the end marker is neither part's

    def reasoning_tokens(self, ids: Sequence[int], state: PromptState) -> int:
        """How many of the output's tokens are its reasoning, markers included (OpenAI's
        `reasoning_tokens`)."""
        split = self.split(ids, state)
        return 0 if split.reasoning is None else len(ids) - len(split.answer)

    def constraint(self, state: PromptState) -> AfterReasoning | None:
        """Where the answer's constraint begins after a prompt in `state`: once this reasoning ends
        (None: at the first token, the prompt having closed it)."""
        if state == "closed":
            return None
        return AfterReasoning(self.start_id, self.end_id, state == "open", tuple(sorted(self.answer_start_ids)))


@dataclass(frozen=True)
class ReplyParts:
    """`reasoning` without its markers and outer whitespace; `content`: the answer's text (special
    tokens left out, leading whitespace cut); `marked`: the same with the special tokens a tool
    format writes kept (`PartsReader`'s `marked_without`), where asked; `ended`: the reasoning has ended."""
    reasoning: str
    content: str
    marked: str | None
    ended: bool


def cut_at_stops(text: str, stops: Iterable[str]) -> str:
    """`text` up to the first of the stop strings in it (as the engine cuts an output's text)."""
    return text[:min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]


class GrowingText:
    """The text of a list of ids that only grows, decoded a window at a time as the engine
    detokenizes (a long reasoning is not decoded whole at every step); an unfinished character at
    its end waits until the list is final."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.text, self._prefix, self._read = "", 0, 0

    def update(self, ids: Sequence[int], final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(list(ids[self._prefix:self._read]), skip_special_tokens=self.skip)
        after = decode(list(ids[self._prefix:]), skip_special_tokens=self.skip)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(ids)
        return self.text


class PartsReader:
    """A reply's parts as its output grows (`read` with the output so far)."""

    def __init__(self, tokenizer: Any, reasoning: Reasoning, state: PromptState, eos_ids: set[int],
                 marked_without: frozenset[int] | None = None) -> None:
        """`marked_without`: also the answer's text with special tokens kept (`ReplyParts.marked`),
        all but these ids."""
        self.reasoning, self.state, self.eos_ids = reasoning, state, eos_ids
        self._reasoning, self._content = GrowingText(tokenizer, True), GrowingText(tokenizer, True)
        self._marked = GrowingText(tokenizer, False) if marked_without is not None else None
        self._hidden = marked_without or frozenset()

    def read(self, ids: Sequence[int], stops: Sequence[str], finish_reason: str | None) -> ReplyParts | None:
        """The parts of the output so far, or None where it holds no reasoning (then it is content,
        as without a parser). A stop string that ended it cuts the part it ended in, as the engine
        cut the text; the reasoning's trailing whitespace goes once it has ended or the output has."""
        ids = list(ids)
        while ids and ids[-1] in self.eos_ids:   # ends of sequence stand last
            ids.pop()
        split = self.reasoning.split(ids, self.state)
        if split.reasoning is None:
            return None
        final = finish_reason is not None
        text = self._reasoning.update(split.reasoning, final or split.ended)
        content = self._content.update(split.answer, final).lstrip()
        marked = None if self._marked is None else \
            self._marked.update([t for t in split.answer if t not in self._hidden], final).lstrip()
        if finish_reason == "stop" and stops:
            if split.ended:
                content = cut_at_stops(content, stops)
                marked = None if marked is None else cut_at_stops(marked, stops)
            else:
                text = cut_at_stops(text, stops)
        text = text.strip() if split.ended or final else text.lstrip()
        return ReplyParts(text, content, marked, split.ended)


def reply_parts(tokenizer: Any, reasoning: Reasoning, ids: Sequence[int], state: PromptState, eos_ids: set[int],
                stops: Sequence[str], finish_reason: str | None,
                marked_without: frozenset[int] | None = None) -> ReplyParts | None:
    """`PartsReader.read` of a whole output at once."""
    return PartsReader(tokenizer, reasoning, state, eos_ids, marked_without).read(ids, stops, finish_reason)
