"""Text in and out of an engine: prompts to token ids, and each request's output ids to text,
incrementally, with its stop strings."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from drafttree.engine.sequence import Sequence
from drafttree.structured.reasoning import Reasoning


# tokenizer_config.json classes that are tokenizer.json as is: AutoTokenizer resolves them to the
# class loaded directly below, after importing its model-config machinery (1.45 s against 0.69 s on
# two CPU cores, transformers 5.25)
PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def has_tokenizer(path: Path | None) -> bool:
    """Whether the model directory holds a tokenizer (else the model takes token ids only)."""
    return path is not None and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                   "tokenizer.model"))


def load_tokenizer(path: Path | None, trust_remote_code: bool = False):
    """The model directory's tokenizer (transformers'), or None where it has none. A tokenizer
    that is code of the model's own (`tokenizer_code`) runs only with `trust_remote_code`; where
    the directory also has a tokenizer.json, that is read without it, else the model is refused."""
    if not has_tokenizer(path):
        return None
    code = tokenizer_code(path)
    fast = (path / "tokenizer.json").is_file()
    if code is not None and trust_remote_code:
        # the class itself, not AutoTokenizer: with Kimi K2.5/K2.6, transformers 5 may build a generic
        # backend from the files instead (which splits <think>) or fail building it
        from transformers.dynamic_module_utils import get_class_from_dynamic_module
        return get_class_from_dynamic_module(code, str(path), local_files_only=True).from_pretrained(str(path))
    if code is not None and not fast:
        raise ValueError(f"{path}: the model's tokenizer is code it ships ({code}); running it needs "
                         "trust_remote_code (--trust-remote-code)")
    if fast and (code is not None or _tokenizer_class(path) in PLAIN_FAST):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def with_chat_template(tokenizer, template: str | None):
    """The tokenizer rendering with `template` in place of its own, where one is given."""
    if template is not None and tokenizer is not None:
        tokenizer.chat_template = template
    return tokenizer


def tokenizer_code(path: Path) -> str | None:
    """The tokenizer class the model ships as code ("tokenization_kimi.TikTokenTokenizer": Kimi
    K2's, on tiktoken), from tokenizer_config.json's auto_map, or None."""
    try:
        ref = json.loads((path / "tokenizer_config.json").read_text()).get("auto_map", {}).get("AutoTokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(ref, (list, tuple)):
        ref = next((r for r in ref if r), None)
    return ref if isinstance(ref, str) and ref else None


def _tokenizer_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


class TokenTexts:
    """Each token's text decoded alone, as vLLM decodes a log-probability's token, remembered;
    without a tokenizer `missing(token)` (the server: "token_id:<id>", vLLM's form; the Python
    API: None)."""

    def __init__(self, tokenizer, missing: Callable[[int], str | None] = lambda t: f"token_id:{t}") -> None:
        self.tokenizer, self.missing, self.texts = tokenizer, missing, {}

    def __call__(self, token: int) -> str | None:
        if token not in self.texts:
            self.texts[token] = self.missing(token) if self.tokenizer is None else self.tokenizer.decode([token])
        return self.texts[token]


@dataclass(frozen=True)
class Tokenized:
    """A prompt's ids as read already (`TextCodec.tokenize`'s, or ids checked by `encode`) and its
    text, if it was text: a server tokenizes on its own threads, so that a long prompt's
    tokenization does not hold the engine's, which takes the ids as they are."""
    text: str | None
    ids: list[int]


class TextCodec:
    """A model's tokenizer (or none: token ids only), its end-of-sequence ids and, for a reasoning
    model, its reasoning format."""

    def __init__(self, tokenizer, eos_ids: set[int], vocab_size: int, where: Path | None = None,
                 reasoning: Reasoning | None = None) -> None:
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.eos_ids = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.vocab_size = vocab_size
        self.where = where

    def tokenize(self, text: str) -> Tokenized:
        """`encode` of a text, on any thread (the tokenizer's work runs with Python's lock released)."""
        return Tokenized(text, self.encode(text)[0])

    def encode(self, prompt: str | list[int] | Tokenized) -> tuple[list[int], str | None]:
        """(token ids, the text or None): text is tokenized as is (no special tokens added); ids
        are checked against the vocabulary."""
        if isinstance(prompt, Tokenized):
            return list(prompt.ids), prompt.text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.where} has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return ids, None

    def detokenize(self, seq: Sequence) -> None:
        """Extend seq.text by the new tokens' text: decode a short window ending at the new tokens
        (not the whole output) and hold back a trailing partial character; a stop string in it
        ends the request there."""
        ids, p = seq.output_ids, seq.params
        if ids and not p.include_stop_str_in_output and \
                ((ids[-1] in self.eos_ids and not p.ignore_eos) or ids[-1] in p.stop_token_ids):
            ids = ids[:-1]   # the token that ended the output (append stops at it: it stands last)
        prefix, read = seq.detok_offsets
        opts = {"skip_special_tokens": p.skip_special_tokens}
        if not p.spaces_between_special_tokens:   # passed only when asked: not every tokenizer takes it
            opts["spaces_between_special_tokens"] = False
        before = self.tokenizer.decode(ids[prefix:read], **opts)
        after = self.tokenizer.decode(ids[prefix:], **opts)
        if len(after) > len(before) and (not after.endswith("\ufffd") or seq.finished):
            old = len(seq.text)
            seq.text += after[len(before):]
            seq.detok_offsets = (max(read, len(ids) - 4), len(ids))
            for stop in p.stop:
                i = seq.text.find(stop, max(0, old - len(stop) + 1))
                if i >= 0:
                    seq.text = seq.text[:i + len(stop) if p.include_stop_str_in_output else i]
                    seq.finish("stop")
                    seq.finish_reason = "stop"   # a stop string in the last tokens outranks the length limit
                    seq.stop_reason = stop
