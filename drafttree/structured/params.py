"""What a request asks its output to be: one of a JSON schema, any JSON object, a regex, a choice
of strings or a grammar (Lark, or GBNF/EBNF as llama.cpp writes it), vLLM's `structured_outputs`
under the same names; for a reasoning model, from the end of its reasoning on."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class AfterReasoning:
    """A constraint that holds once the model's reasoning has ended: until the token `end` that
    closes it every token is free but an end of sequence (a reasoning model must answer); then
    whitespace, then the constraint. `opened`: the prompt opened the reasoning; else the output
    may open it with `start` as its first token, or begin with the constrained answer.
    `answer_starts`: tokens that would end the reasoning without `end` (the reasoning may not
    hold them: here only `end` ends it)."""
    start: int
    end: int
    opened: bool
    answer_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "answer_starts", tuple(self.answer_starts))
        if not all(isinstance(t, int) and t >= 0 for t in (self.start, self.end)) or self.start == self.end:
            raise ValueError(f"structured outputs: the reasoning's start and end must be two token ids, got "
                             f"{self.start}, {self.end}")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of the fields is set. `json`: a JSON schema (a dict or its text); `json_object`:
    any JSON object; `regex`: the whole output matches it; `choice`: the output is one of these
    strings; `grammar`: a Lark grammar (or GBNF / EBNF, converted). `name` only labels it in errors."""
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    after_reasoning: AfterReasoning | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.after_reasoning, dict):
            object.__setattr__(self, "after_reasoning", AfterReasoning(**self.after_reasoning))
        given = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured outputs: a JSON schema is an object (or true / false)")
        elif self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured outputs: a JSON schema is an object (or true / false)")
        for k in ("regex", "grammar"):
            v = self._value(k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"structured outputs: {k} must be a non-empty string")

    def _value(self, kind: str) -> Any:
        return getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._value(k) not in (None, False))

    def key(self) -> str:
        """A text that names the constraint exactly (compiled grammars are cached by it)."""
        v = self._value(self.kind)
        text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
        r = self.after_reasoning
        head = "" if r is None else f"after_reasoning({r.start},{r.end},{int(r.opened)},{list(r.answer_starts)}):"
        return f"{head}{self.kind}:{text}"
