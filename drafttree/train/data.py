"""Training data: regenerated sequences (the prompts are `drafttree.prompts`').

Sequence files (written by `regen.py`) hold {"i", "prompt_ids", "response_ids"} per line, and
"turn" for a conversation's later turns.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


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
