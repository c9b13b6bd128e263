"""Acceptance of a trained drafter measured in the real decoder (not training accuracy)."""
from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from drafttree.prompts import Prompt
from drafttree.sampling import SamplingParams
from drafttree.train.regen import RegenConfig, encode_prompt, make_llm


@dataclass(frozen=True)
class Cell:
    """One τ measurement: the DFlash chain (budget 1) or a DDTree budget, at one temperature."""
    method: str = "dflash"
    budget: int = 1
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in ("dflash", "ddtree"):
            raise ValueError(f"method must be dflash or ddtree, got {self.method!r}")
        if self.budget < 1 or (self.method == "dflash" and self.budget != 1):
            raise ValueError(f"budget must be >= 1 (1 for the DFlash chain), got {self.budget}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def label(self) -> str:
        name = "dflash" if self.method == "dflash" else f"ddtree{self.budget}"
        return f"{name} T={self.temperature:g}"


def cells_of(methods: list[str], budgets: list[int], temperatures: list[float]) -> list[Cell]:
    """Every method × temperature; DDTree at each budget, the DFlash chain once."""
    out = []
    for m in methods:
        for b in ([1] if m == "dflash" else budgets):
            out.extend(Cell(m, b, t) for t in temperatures)
    if not out:
        raise ValueError("no τ cell: give a method (and budgets for ddtree)")
    return out


def measure_tau(drafter_dir: Path, prompts: list[Prompt], cfg: RegenConfig, max_tokens: int = 256,
                compare_plain: bool = False, cell: Cell = Cell()) -> dict[str, Any]:
    """τ = committed tokens per round (bonus included) of `prompts` decoded in one cell (default:
    the DFlash chain at T = 0). With `compare_plain`, also decode without speculation and count
    differing outputs (equal at T > 0 too: each request has a seed)."""
    return measure_cells(drafter_dir, prompts, cfg, [cell], max_tokens, compare_plain)[cell.label]


def measure_cells(drafter_dir: Path, prompts: list[Prompt], cfg: RegenConfig, cells: list[Cell],
                  max_tokens: int = 256, compare_plain: bool = False) -> dict[str, dict[str, Any]]:
    """τ of every cell, by label; one engine per method and budget, serving each temperature."""
    run = replace(cfg, max_tokens=max_tokens)
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    ids: list[list[int]] | None = None
    for method, budget in dict.fromkeys((c.method, c.budget) for c in cells):
        # a fixed budget and no schedule (a drafter config's '16:0' would make rounds over 16+ rows
        # plain), drafting at T > 0 too: τ of the drafter, not of a choice
        llm = make_llm(run, draft_model=str(drafter_dir), spec=method, budget=budget, budget_schedule="none",
                       speculate_sampled=True)
        if ids is None:
            ids = [encode_prompt(llm, p, cfg.chat_template) for p in prompts]
            ids = [p for p in ids if 0 < len(p) <= cfg.max_prompt_tokens]
            if not ids:
                raise ValueError("no evaluation prompt fits --max-prompt-tokens")
        for c in (c for c in cells if (c.method, c.budget) == (method, budget)):
            results[c.label], outputs[c.label] = _decode(llm, ids, c, max_tokens, cfg.seed)
        # the engine (its KV pool: by default a share of the free memory) goes before the next is built
        llm.shutdown()
        del llm
        _release()
    if compare_plain:
        plain = make_llm(run, spec="none")
        # the same seeds give the same plain output for every cell at one temperature
        for t in dict.fromkeys(c.temperature for c in cells):
            want = [o.token_ids for o in plain.generate(ids, _params(t, max_tokens, cfg.seed, len(ids)))]
            for c in (c for c in cells if c.temperature == t):
                results[c.label]["mismatches"] = sum(a != b for a, b in zip(outputs[c.label], want))
        plain.shutdown()
        del plain
        _release()
    return results


def _params(temperature: float, max_tokens: int, seed: int, n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(n)]


def _decode(llm, ids: list[list[int]], cell: Cell, max_tokens: int, seed: int) -> tuple[dict[str, Any], list[list[int]]]:
    before = llm.engine.stats.budget_hist
    t0 = time.perf_counter()
    outs = llm.generate(ids, _params(cell.temperature, max_tokens, seed, len(ids)))
    seconds = time.perf_counter() - t0
    lengths = [k for o in outs for k in o.metrics["accept_lengths"]]
    hist: dict[int, int] = {}
    for k in lengths:
        hist[k] = hist.get(k, 0) + 1
    return {
        "method": cell.method, "budget": cell.budget, "temperature": cell.temperature,
        "tau": sum(lengths) / max(len(lengths), 1), "rounds": len(lengths), "prompts": len(ids),
        "generated_tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds,
        "accept_histogram": dict(sorted(hist.items())), "block_size": llm.engine.spec.block_size,
        # engine rounds per budget they ran at (0: plain decode rounds; there should be none)
        "budget_histogram": {str(k): v for k, v in sorted((llm.engine.stats.budget_hist - before).items())},
        "max_tokens": max_tokens,
    }, [o.token_ids for o in outs]


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tau_curve(snapshots: Path, prompts: list[Prompt], cfg: RegenConfig, max_tokens: int = 256,
              cells: Sequence[Cell] = (Cell(),)) -> list[dict[str, Any]]:
    """τ of every drafter the trainer saved under `snapshots` (`snapshot_every`) in each cell, in
    step order, each with the step and the response tokens its run had trained on; `tau` is the
    first cell's."""
    dirs = sorted(d for d in snapshots.glob("step*") if (d / "snapshot.json").is_file())
    if not dirs:
        raise ValueError(f"no snapshots in {snapshots} (train with --snapshot-every N)")
    rows = []
    for d in dirs:
        res = measure_cells(d, prompts, cfg, list(cells), max_tokens)
        first = res[cells[0].label]
        rows.append({**json.loads((d / "snapshot.json").read_text()), "drafter": str(d),
                     **{k: first[k] for k in ("tau", "rounds", "prompts", "generated_tokens")},
                     "cells": {k: round(r["tau"], 4) for k, r in res.items()}})
    return rows
