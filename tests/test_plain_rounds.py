"""A plain round of an engine with a drafter runs what a plain engine's does: its decode step, and
the drafter's context write only once per width(CONTEXT) - 1 plain rounds, or before the first
draft after them (the catch-up), which then leaves the drafter's cache as a prefill would; the
chooser's host work is not redone every plain round. Lossless throughout: drafting resumes after
long plain stretches with plain decoding's tokens, at T = 0 and seeded at T > 0."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.engine.budget import DRIFT, GREEDY, REFRESH, BudgetChooser
from drafttree.phases import Phase, SpecConfig
from drafttree.runner.cost import CostTable
from drafttree.spec_decode.acceptance import PRED_SCALE
from tests.tiny import make_drafter, make_target

BLOCK = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    t = make_target(root / "t", "llama")
    return t, make_drafter(root / "d", t, block_size=BLOCK)


def _engine(pair, **kw) -> LLM:
    t, d = pair
    return LLM(model=str(t), draft_model=str(d), spec="ddtree", device="cpu", dtype="float32", max_num_seqs=2,
               max_model_len=256, **kw)


def _force(llm: LLM, pattern: list[int]) -> list[tuple]:
    """The chooser takes the budgets of `pattern` in turn (0 where the round may not run at one);
    returns the steps each round ran, as (phases, budget)."""
    eng, it, ran = llm.engine, itertools.cycle(pattern), []
    eng.chooser.choose = lambda bucket, allowed, rows, cap=None, extra=(), host_rows=0: (lambda b: b if b in allowed else 0)(next(it))
    r, run_round = eng.runner, eng.runner.run_round

    def run(B, mode, n, b=None, **kw):
        ran.append((tuple(st.phase for st in r.round_steps(B, mode, b)), b, int(r.state.start[0])))
        return run_round(B, mode, n, b, **kw)
    r.run_round = run
    return ran


def test_plain_rounds_run_a_decode_step_and_a_rare_context_write(pair):
    """70 plain rounds: each a decode step, a context write before one in width(CONTEXT) - 1 of
    them (a plain engine's round is the decode step alone)."""
    llm = _engine(pair)
    ran = _force(llm, [0])
    out = llm.generate([[3, 1, 4]], SamplingParams(temperature=1.0, seed=3, max_tokens=71, ignore_eos=True))
    K = llm.engine.spec.width(Phase.CONTEXT)
    assert K == 4 * BLOCK and len(ran) == 70
    kinds = Counter(p for p, _, _ in ran)
    assert kinds[(Phase.DECODE,)] + kinds[(Phase.CONTEXT, Phase.DECODE)] == 70
    assert kinds[(Phase.CONTEXT, Phase.DECODE)] == -(-(70 - (K - 1)) // (K - 1)), kinds
    plain = LLM(model=str(pair[0]), spec="none", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=256)
    want = plain.generate([[3, 1, 4]], SamplingParams(temperature=1.0, seed=3, max_tokens=71, ignore_eos=True))
    assert out[0].token_ids == want[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafting_after_long_plain_stretches_catches_up_losslessly(pair, temperature):
    """Plain stretches longer than the pending buffer and shorter, then drafting: the first draft
    after more than max_commit plain rounds writes the pending features first (one context
    phase), a draft after a draft does not; plain decoding's tokens (seeded at T > 0)."""
    pattern = [0] * 40 + [8, 8] + [0] * 3 + [8] + [0] * 20 + [8]
    llm = _engine(pair, budget=8)
    ran = _force(llm, pattern)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1]]
    sp = [SamplingParams(temperature=temperature, seed=11 + i, max_tokens=n, ignore_eos=True)
          for i, n in enumerate((90, 70))]
    outs = llm.generate(prompts, sp)
    plain = LLM(model=str(pair[0]), spec="none", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=256)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, sp)]
    K, pending = llm.engine.spec.width(Phase.CONTEXT), 1   # the most features a row may hold unwritten
    for phases, b, _ in ran:
        first = (Phase.CONTEXT,) if pending > (BLOCK if b else K - 1) else ()
        assert phases == first + ((Phase.DRAFT, Phase.VERIFY) if b else (Phase.DECODE,)), (phases, pending)
        pending = BLOCK if b else (1 if first else pending) + 1
    catch_ups = [p for p, b, _ in ran if b and p[0] is Phase.CONTEXT]
    assert len(catch_ups) >= 2 and any(p[0] is Phase.DRAFT for p, _, _ in ran)


def test_the_catch_up_leaves_the_drafters_cache_as_a_prefill_would(pair):
    """After 40 plain rounds, one drafting round: the drafter's cache holds at every position
    committed before it what a prefill of the same tokens writes there."""
    llm = _engine(pair, budget=8)
    ran = _force(llm, [0] * 40 + [8] * 30)
    prompt = [3, 1, 4, 1, 5]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=46, ignore_eos=True))[0].token_ids
    n = next(start for phases, b, start in ran if b)   # committed positions when drafting resumed
    assert n == len(prompt) + 40 and ran[40][0] == (Phase.CONTEXT, Phase.DRAFT, Phase.VERIFY)
    r = llm.engine.runner
    table = r.state.block_table
    table[0] = torch.arange(1, table.shape[1] + 1)   # a fresh pool handed out pages 1, 2, ... in order
    t, d = pair
    ref = LLM(model=str(t), draft_model=str(d), spec="ddtree", device="cpu", dtype="float32", max_num_seqs=2,
              max_model_len=256)
    ref.generate([prompt + out[:-1]], SamplingParams(temperature=0.0, max_tokens=1))
    ps = r.kv.page_size
    for a, b in ((r.dkv.k, ref.engine.runner.dkv.k), (r.dkv.v, ref.engine.runner.dkv.v)):
        torch.testing.assert_close(a[:, 0, :, ps:ps + n], b[:, 0, :, ps:ps + n], atol=1e-5, rtol=1e-5)


def _table() -> CostTable:
    spec = SpecConfig("ddtree", block_size=16, budget=31, adaptive=True)
    t = CostTable(spec)
    for phase, width, s in ((Phase.DECODE, 1, 1.0), (Phase.CONTEXT, 64, 0.63), (Phase.DRAFT, 16, 0.5),
                            (Phase.VERIFY, 5, 1.0), (Phase.VERIFY, 9, 1.2), (Phase.VERIFY, 17, 1.6),
                            (Phase.VERIFY, 32, 2.5)):
        t.seconds[(phase, 1, width, False)] = s
    return t


def test_a_plain_stretch_ranks_the_budgets_once_per_refresh():
    """While nothing it depends on is observed, the choice is ranked once per REFRESH rounds (the
    same choices as ranking every round); an observation or another batch ranks it again."""
    t = _table()
    c = BudgetChooser(t, t.spec.budgets)
    preds = [int(p * PRED_SCALE) for p in (1.1, 1.15, 1.2, 1.25)]
    c.observe(GREEDY, preds, preds)
    fresh = BudgetChooser(t, t.spec.budgets, cal=c.cal, pooled=c.pooled)
    ranked, rank = [], c._rank
    c._rank = lambda *a: ranked.append(a) or rank(*a)
    allowed, one = t.spec.budgets_at(1), Counter({GREEDY: 1})
    picks = [c.choose(1, allowed, one) for _ in range(100)]
    want = []
    for _ in range(100):
        fresh._kept = None
        want.append(fresh.choose(1, allowed, one))
    assert picks == want and 0 in picks and len(ranked) == -(-100 // REFRESH)
    c.observe(GREEDY, preds, preds)
    c.choose(1, allowed, one)
    c.choose(1, allowed, Counter({GREEDY: 2}))
    assert len(ranked) == -(-100 // REFRESH) + 2


def test_a_new_setting_starts_from_its_kind_with_the_kinds_certainty():
    """A sampler setting first seen after others of its kind starts from their pooled calibration,
    as certain as that one is: one round that accepts nothing moves it by the filter's gain, not
    to nothing; the very first setting starts from the drafter's own prediction, counted as one
    observation: its first round weighs about half."""
    t = _table()
    c = BudgetChooser(t, t.spec.budgets)
    preds = [int(p * PRED_SCALE) for p in (1.5, 2.0, 2.5, 3.0)]
    nothing = [PRED_SCALE] * 4
    c.observe(GREEDY, preds, nothing)                    # the first ever: half way to nothing
    assert c.cal[GREEDY].ratio(3) == pytest.approx(0.5, abs=0.01)
    warm, hot = (0.7, 1.0, 0), (1.0, 1.0, 0)
    for _ in range(40):
        c.choose(1, t.spec.budgets_at(1), Counter({warm: 1}))
        c.observe(warm, preds, preds)
    assert c.cal[warm].ratio(3) == pytest.approx(1.0, abs=0.02)
    pooled = c.pooled[False]
    gain = (pooled.var + DRIFT) / (pooled.var + DRIFT + 1)
    assert pooled.ratio(3) == pytest.approx(1.0) and gain < 0.15
    c.observe(hot, preds, nothing)                       # a new sampled setting's unlucky first round
    assert c.cal[hot].ratio(3) == pytest.approx(1 - gain, abs=0.01)
