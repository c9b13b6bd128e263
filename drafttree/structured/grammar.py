"""Grammars on llguidance: the tokenizer's view it needs (built once per engine), compiling a
request's constraint to a matcher (errors refused by name, before the request runs) and the
matcher's host-side use: token masks, forced tokens, advancing over committed tokens."""
from __future__ import annotations

import copy
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from drafttree.structured.masks import token_bits
from drafttree.structured.params import AfterReasoning, StructuredOutputs

log = logging.getLogger(__name__)

CACHE_SIZE = 256        # compiled grammars kept (their text, validated) per engine
ALL_ALLOWED = -1        # a bitmask word with every token allowed
# Masks computed one after the other up to this many at a time: llguidance's thread pool costs
# ~90 us a call to wake, several masks' worth (a JSON state's mask took 2-12 us when timed alone,
# 28-55 us inside an engine between rounds, its caches cold; on two CPU cores, where no pool is
# made: where the pool's threads pay off instead on a many-core host is not timed).
SERIAL_MASKS = 16


def _llguidance():
    try:
        import llguidance
    except ImportError as e:   # a dependency of the package; a broken install says so here
        raise ValueError(f"structured outputs need the llguidance package ({e})") from None
    return llguidance


def mask_words(vocab: int) -> int:
    """int32 words of a token bitmask over `vocab` ids (bit t % 32 of word t // 32: token t allowed)."""
    return (vocab + 31) // 32


class _ByteTokens:
    """A tokenizer as llguidance's generic wrapper reads it: every id's bytes (decoded alone),
    for tokenizers whose pipeline llguidance cannot read from its JSON (word-level ones)."""

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        n = len(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.tokens = [tokenizer.decode([i]).encode("utf-8") if i < n else b"" for i in range(vocab)]
        self.special_token_ids = sorted(i for i in special if i < vocab)
        self.eos_token_id = eos
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tok = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tok.encode(s, add_special_tokens=False)


def llg_tokenizer(tokenizer: Any, vocab: int, eos_ids: set[int]):
    """llguidance's tokenizer for a Hugging Face one, over `vocab` ids (the logits' width: ids past
    the tokenizer's are never allowed), with every id of `eos_ids` as an end of sequence."""
    llg = _llguidance()
    eos = sorted(eos_ids) or None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        b = copy.copy(backend)
        b.no_padding()
        b.no_truncation()
        try:
            return llg.LLTokenizer(b.to_str(), n_vocab=vocab, eos_token=eos)
        except Exception as e:   # a pipeline llguidance does not read (e.g. word-level): bytes per id
            log.info("llguidance reads the tokenizer id by id (%s)", e)
    first = eos[0] if eos else 0
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(tokenizer, vocab, first)), n_vocab=vocab,
                           eos_token=eos)


def grammar_text(so: StructuredOutputs, eos_ids: Iterable[int] = ()) -> str:
    """llguidance's grammar for a constraint (not yet checked: `GrammarCompiler.check` does);
    `eos_ids`: the ends of sequence a reasoning (`so.after_reasoning`) may not end on."""
    text = _body_text(so)
    return text if so.after_reasoning is None else _after_reasoning(text, so.after_reasoning, eos_ids)


def _body_text(so: StructuredOutputs) -> str:
    """The constraint's own grammar."""
    llg = _llguidance()
    kind = so.kind
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "json":
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return llg.LLMatcher.grammar_from_json_schema(schema)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:
        return llg.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise ValueError(f"structured outputs: the grammar is neither Lark nor GBNF: {e}") from None


def _after_reasoning(text: str, r: AfterReasoning, eos_ids: Iterable[int]) -> str:
    """`text` (a Lark grammar, or llguidance's grammar list) behind a reasoning: a top grammar
    whose tokens up to `r.end` are free (ends of sequence aside), then whitespace, then `text`'s
    first grammar, referenced by name."""
    top = json.loads(text) if text.lstrip().startswith("{") else {"grammars": [{"lark_grammar": text}]}
    grammars = top["grammars"]
    body = grammars[0].get("name") or "drafttree_answer"
    grammars[0]["name"] = body
    banned = ",".join(str(t) for t in sorted({r.end, *r.answer_starts, *eos_ids}))
    thought = f"<[^{banned}]>* <[{r.end}]>"
    if not r.opened:
        thought = f"(<[{r.start}]> {thought})?"
    top["grammars"] = [{"lark_grammar": f"start: {thought} /[ \\t\\r\\n]*/ @{body}"}] + grammars
    return json.dumps(top)


class GrammarCompiler:
    """One engine's grammars: compiles constraints to matchers over the engine's vocabulary,
    caching each grammar's checked text."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: set[int]) -> None:
        self.llg = _llguidance()
        self.vocab, self.eos_ids = vocab, set(eos_ids)
        self.tokenizer = llg_tokenizer(tokenizer, vocab, self.eos_ids)
        self.words = mask_words(vocab)
        self._cache: OrderedDict[str, str] = OrderedDict()
        # llguidance's own default (80 % of the CPUs, at most 32); one thread would only add the
        # pool's hand-off to each call: then every call computes its masks in this thread
        threads = min(32, int(0.8 * len(os.sched_getaffinity(0)))) if hasattr(os, "sched_getaffinity") else 0
        self.executor = self.llg.LLExecutor(threads) if threads > 1 else None

    def compile(self, so: StructuredOutputs) -> str:
        """The checked grammar text of a constraint; ValueError naming what is wrong or unsupported
        (a JSON schema keyword llguidance does not implement, a bad regex, a Lark error)."""
        key = so.key()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        text = grammar_text(so, self.eos_ids)
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if is_error:
            what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}[so.kind]
            raise ValueError(f"structured outputs: the {what} is not supported: {messages[0].strip()}")
        self._cache[key] = text
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return text

    def matcher(self, so: StructuredOutputs) -> "Matcher":
        return self.build(self.compile(so), so.after_reasoning)

    def build(self, text: str, after_reasoning: AfterReasoning | None = None) -> "Matcher":
        """A matcher of a checked grammar text (`compile`'s; `after_reasoning`: the one its
        constraint was compiled with). llguidance builds its parser with Python's lock released:
        any thread may build one while the engine steps."""
        m = self.llg.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise ValueError(f"structured outputs: {m.get_error()}")
        return Matcher(m, self, after_reasoning)

    def fill_masks(self, states: list[tuple["Matcher", int]], out: np.ndarray) -> None:
        """Row i of out [N, words] int32 := the mask of each (matcher, i), computed in parallel
        (more than SERIAL_MASKS of them, on several CPUs); a state that allows nothing (a matcher
        in error) gets its end-of-sequence ids."""
        self.fill_raw_masks([(m.m, i) for m, i in states], out)

    def fill_raw_masks(self, states: list[tuple[Any, int]], out: np.ndarray) -> None:
        """`fill_masks` for llguidance's own matchers (`Matcher.m`)."""
        if not states:
            return
        assert out.dtype == np.int32 and out.flags.c_contiguous and out.shape[1] == self.words
        size = self.words * 4
        if self.executor is None or len(states) <= SERIAL_MASKS:
            base, n = out.ctypes.data, out.shape[0]
            if not all(0 <= i < n for _, i in states):   # a raw write: checked as the pool checks
                raise IndexError(f"mask rows {[i for _, i in states]} for a buffer of {n}")
            for m, i in states:
                m.unsafe_compute_mask_ptr(base + i * size, size)
        else:
            self.executor.unsafe_compute_mask_ptr(states, out.ctypes.data, size, out.shape[0])
        rows = np.fromiter((i for _, i in states), dtype=np.int64, count=len(states))
        # a mask that allows something nearly always does so in its first words: the whole of
        # a row is read only where those are empty
        head = rows[~out[rows, :8].any(axis=1)]
        for i in head[~out[head].any(axis=1)].tolist():
            out[i] = 0 if self.eos_ids else ALL_ALLOWED
            words = out[i].view(np.uint32)
            for e in self.eos_ids:
                words[e >> 5] |= np.uint32(1 << (e & 31))


@dataclass(frozen=True)
class Thought:
    """A constraint's state inside the reasoning it leaves free (`AfterReasoning`): the same
    tokens allowed at every position (`mask`; `allowed[t]` 1 where token t is), until `end`
    closes it; after `end` the answer's grammar starts in one state whatever the reasoning held
    (`after_end`, its mask). A draft tree grows such a row without copies of its matcher
    (`structured.tree.grow`)."""
    allowed: bytes
    end: int
    mask: np.ndarray        # [words] int32
    after_end: np.ndarray   # [words] int32


class Matcher:
    """A request's grammar state on the host: it advances over committed tokens only; a draft
    tree grows copies of its llguidance matcher (`structured.tree.grow`), or, inside a reasoning
    its constraint leaves free, uses the reasoning's two masks (`thought`)."""

    def __init__(self, m: Any, compiler: GrammarCompiler, after_reasoning: AfterReasoning | None = None) -> None:
        self.m, self.compiler = m, compiler
        self.reasoning = after_reasoning
        # where the output is against the reasoning: "before" it may open, "in" it, None past it
        self.phase = None if after_reasoning is None else "in" if after_reasoning.opened else "before"
        self._thought: Thought | None = None

    def advance(self, tokens: list[int]) -> int:
        """Consume committed tokens; returns how many the grammar took (all, unless one was
        forbidden: a defect upstream, which the caller reports)."""
        n = self.m.try_consume_tokens(tokens) if tokens else 0
        if n < len(tokens) and self.m.is_accepting() and self.m.consume_token(tokens[n]):
            n += 1   # an end of sequence where the grammar may end (try_consume_tokens takes none)
        r = self.reasoning
        if self.phase is not None and n:
            taken = tokens[:n]
            if self.phase == "before":   # the reasoning opens with the first token, or never
                self.phase, taken = ("in", taken[1:]) if taken[0] == r.start else (None, [])
            if self.phase == "in" and r.end in taken:
                self.phase = None
        return n

    def thought(self) -> Thought | None:
        """The reasoning's masks while the output is inside it, else None."""
        if self.phase != "in":
            return None
        if self._thought is None:
            r, words = self.reasoning, self.compiler.words
            masks = np.empty((2, words), dtype=np.int32)
            after = self.m.deep_copy()
            after.consume_token(r.end)
            self.compiler.fill_raw_masks([(self.m, 0), (after, 1)], masks)
            allowed = token_bits(masks[0], self.compiler.vocab).tobytes()
            self._thought = Thought(allowed, r.end, masks[0], masks[1])
        return self._thought

    @property
    def stopped(self) -> bool:
        """The grammar admits no more tokens (only an end of sequence)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()
