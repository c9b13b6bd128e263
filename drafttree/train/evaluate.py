"""Acceptance of a trained drafter measured in the real decoder (not training accuracy)."""
from __future__ import annotations

import gc
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from drafttree.sampling import SamplingParams
from drafttree.train.data import Prompt
from drafttree.train.regen import RegenConfig, encode_prompt, make_llm


def measure_tau(drafter_dir: Path, prompts: list[Prompt], cfg: RegenConfig, max_tokens: int = 256,
                compare_plain: bool = False) -> dict[str, Any]:
    """Greedy (T=0) DFlash decoding of `prompts`; τ = committed tokens per round, bonus included.
    With `compare_plain`, also decode without speculation and count differing outputs."""
    run = replace(cfg, max_tokens=max_tokens)
    # the chain in every round (a fixed budget, and no schedule: a drafter config's '16:0' would
    # make rounds over 16+ rows plain): τ of the drafter, not of a choice
    llm = make_llm(run, draft_model=str(drafter_dir), spec="dflash", budget=1, budget_schedule="none")
    ids = [encode_prompt(llm, p, cfg.chat_template) for p in prompts]
    ids = [p for p in ids if 0 < len(p) <= cfg.max_prompt_tokens]
    if not ids:
        raise ValueError("no evaluation prompt fits --max-prompt-tokens")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(ids, params)
    seconds = time.perf_counter() - t0
    lengths = [k for o in outs for k in o.metrics["accept_lengths"]]
    hist: dict[int, int] = {}
    for k in lengths:
        hist[k] = hist.get(k, 0) + 1
    result: dict[str, Any] = {
        "tau": sum(lengths) / max(len(lengths), 1), "rounds": len(lengths), "prompts": len(ids),
        "generated_tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds,
        "accept_histogram": dict(sorted(hist.items())), "block_size": llm.engine.spec.block_size,
        # engine rounds per budget they ran at (0: plain decode rounds; there should be none)
        "budget_histogram": {str(k): v for k, v in sorted(llm.engine.stats.budget_hist.items())},
        "max_tokens": max_tokens,
    }
    if compare_plain:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        plain = make_llm(run).generate(ids, params)
        result["mismatches"] = sum(a.token_ids != b.token_ids for a, b in zip(outs, plain))
    return result


def tau_curve(snapshots: Path, prompts: list[Prompt], cfg: RegenConfig, max_tokens: int = 256) -> list[dict[str, Any]]:
    """τ (`measure_tau`) of every drafter the trainer saved under `snapshots` (`snapshot_every`),
    in step order, each with the step and the response tokens its run had trained on."""
    dirs = sorted(d for d in snapshots.glob("step*") if (d / "snapshot.json").is_file())
    if not dirs:
        raise ValueError(f"no snapshots in {snapshots} (train with --snapshot-every N)")
    rows = []
    for d in dirs:
        res = measure_tau(d, prompts, cfg, max_tokens)
        rows.append({**json.loads((d / "snapshot.json").read_text()), "drafter": str(d),
                     **{k: res[k] for k in ("tau", "rounds", "prompts", "generated_tokens")}})
        gc.collect()
    return rows
