"""benchmarks/budget_replay.py: its trace of every position holds, at each position a fixed budget
reaches, the very round that budget ran there; its exact replay walks a trace as the rounds would
run."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from drafttree import LLM
from drafttree.spec_decode.acceptance import PRED_SCALE
from tests.helpers import greedy, make_prompts

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "budget_replay.py"
_spec = importlib.util.spec_from_file_location("budget_replay", _path)
replay_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay_mod)


def test_every_position_holds_the_rounds_a_fixed_budget_runs(zoo):
    pair = zoo("llama")
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", device="cpu",
              dtype="float32", max_num_seqs=8, max_model_len=128)
    rounds = replay_mod.at_largest_budget(llm)
    prompt = make_prompts(pair.vocab)[0]
    out = llm.generate([prompt], greedy(20))[0]
    ran = list(rounds)
    exact = replay_mod.every_position(llm, prompt, out.token_ids)
    assert len(exact) == len(out.token_ids) - 1
    pos = 0
    for preds, seen in ran:
        if pos >= len(exact):
            break
        assert exact[pos] == (preds, seen), pos
        pos += round(seen[-1] / PRED_SCALE)
    assert pos >= len(exact) and len(ran) >= 2
    # the engine is left as it was: one observation per sampler setting again
    import drafttree.engine.engine as engine_module
    from drafttree.engine.budget import sampler_key
    assert engine_module.sampler_key is sampler_key


def _trace(taus: list[list[int]]) -> list:
    """A trace of every position: round j accepts taus[j][i] at budgets[i]; predictions as seen."""
    return [([t * PRED_SCALE for t in ts], [t * PRED_SCALE for t in ts]) for ts in taus]


def test_exact_replay_walks_the_rounds_a_policy_runs():
    budgets = [4, 8]
    # positions 0..5: a fixed budget 8 runs the rounds at 0, 3 and 4 (3 + 1 + 2 tokens)
    taus = [[2, 3], [1, 1], [1, 1], [1, 1], [2, 2], [1, 1]]
    prices = {0: 1.0, 4: 2.0, 8: 2.5}
    r8 = replay_mod.replay(budgets, {"p": _trace(taus)}, 8, prices, resume="exact")
    assert r8["rounds"] == {"8": 3} and r8["tokens_per_ms"] == pytest.approx(6 / 7.5)
    r0 = replay_mod.replay(budgets, {"p": _trace(taus)}, "oracle", prices, resume="exact")
    # the oracle drafts where a round beats a plain step per ms (position 0 only: 3 / 2.5 > 1)
    assert r0["rounds"] == {"0": 3, "8": 1} and r0["tokens_per_ms"] == pytest.approx(6 / 5.5)
    # a round past the trace's end counts only the tokens up to it
    end = replay_mod.replay(budgets, {"p": _trace([[1, 1], [4, 5]])}, 8, prices, resume="exact")
    assert end["tokens_per_ms"] == pytest.approx(2 / 5.0)
    auto = replay_mod.replay(budgets, {"p": _trace(taus * 20)}, "auto", prices, resume="exact")
    assert sum(auto["rounds"].values()) >= 120 / 3


def test_batched_replay_runs_every_unfinished_row_at_one_budget():
    budgets, prices = [4, 8], {0: 1.0, 4: 2.0, 8: 2.5}
    a = _trace([[2, 3], [1, 1], [1, 1], [1, 1], [2, 2], [1, 1]])
    b = _trace([[1, 1], [2, 2], [1, 1]])
    # budget 8: a commits 3, 1, 2 and b 1, 2 (then it is done): 9 tokens in 3 rounds
    r = replay_mod.replay_batched(budgets, {"a": a, "b": b}, 8, prices, 2)
    assert r["rounds"] == {"8": 3} and r["tokens_per_ms"] == pytest.approx(9 / 7.5)
    # a batch of one is the exact replay
    for policy in (4, 8, "auto"):
        one = replay_mod.replay_batched(budgets, {"a": a, "b": b}, policy, prices, 1)
        assert one == replay_mod.replay(budgets, {"a": a, "b": b}, policy, prices, resume="exact")
