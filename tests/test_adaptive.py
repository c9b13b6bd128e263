"""Choosing the budget per round: the acceptance model against exact enumeration, the chooser
against hand-computed rates, and losslessness when the budget changes between rounds (0, a
decode round, included), at T = 0 token for token and at T > 0 with the same seed."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.engine.budget import DRIFT, EMA, GREEDY, PLAIN_STALE, PROBE_MAX, PROBE_SHARE, BudgetChooser
from drafttree.phases import Phase, SpecConfig
from drafttree.runner import cost
from drafttree.runner.cost import CostTable
from drafttree.spec_decode.acceptance import PRED_SCALE, expected_accept, predictions_at
from drafttree.spec_decode.tree import accept, build_tree, chain_tree
from tests.helpers import greedy, make_prompts


def _exact_expected_tau(probs: torch.Tensor, tree) -> float:
    """E[τ] when the target's token at depth d is drawn from the drafter's q_d, independently:
    every continuation enumerated, each tree walked by `accept` (one request)."""
    D, V = probs.shape
    total = 0.0
    for ys in itertools.product(range(V), repeat=D):
        # the target's pick at a node of depth d is its token at position d + 1
        picks = torch.tensor([ys[min(int(d), D - 1)] for d in tree.depth[0]])[None]
        tau = int(accept(tree, picks, D).accept_len[0])
        total += float(torch.prod(probs[torch.arange(D), torch.tensor(ys)])) * tau
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_accept_is_the_exact_expectation_at_every_budget(seed):
    g = torch.Generator().manual_seed(seed)
    D, V = 3, 3
    logits = torch.randn(1, D, V, generator=g) * 2
    probs = logits[0].softmax(-1)
    full = build_tree(logits, torch.zeros(1, dtype=torch.long), 12)
    values = expected_accept(logits, full)
    assert values.shape == (1, 13) and values[0, 0] == 1.0
    for b in (1, 2, 3, 5, 8, 12):
        tree = full.first(b + 1)
        assert values[0, b].item() == pytest.approx(_exact_expected_tau(probs, tree), abs=1e-5), b
        # the first b nodes are the best tree of budget b: the builder at b scores the same
        alone = expected_accept(logits, build_tree(logits, torch.zeros(1, dtype=torch.long), b))
        assert alone[0, -1].item() == pytest.approx(values[0, b].item(), abs=1e-5)
    assert torch.all(values[0, 1:] >= values[0, :-1])
    got = predictions_at(values, (2, 8, 40))
    assert got.tolist() == [[round(values[0, 2].item() * PRED_SCALE), round(values[0, 8].item() * PRED_SCALE),
                             round(values[0, 12].item() * PRED_SCALE)]]


def test_expected_accept_of_a_chain_is_the_sum_of_prefix_products():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 5, generator=g)
    probs = logits.softmax(-1)
    chain = chain_tree(logits.argmax(-1), torch.zeros(2, dtype=torch.long))
    got = expected_accept(logits, chain)[:, -1]
    top = probs.max(-1).values
    want = 1 + top.cumprod(-1).sum(-1)
    torch.testing.assert_close(got, want)
    assert got[0].item() == pytest.approx(_exact_expected_tau(probs[0], chain_tree(logits[:1].argmax(-1),
                                                                                    torch.zeros(1).long())), 1e-5)


def _table() -> CostTable:
    spec = SpecConfig("ddtree", block_size=16, budget=31, adaptive=True)
    t = CostTable(spec)
    for phase, width, s in ((Phase.DECODE, 1, 1.0), (Phase.CONTEXT, 64, 1.26), (Phase.DRAFT, 16, 0.5),
                            (Phase.VERIFY, 5, 1.0), (Phase.VERIFY, 9, 1.2), (Phase.VERIFY, 17, 1.6),
                            (Phase.VERIFY, 32, 2.5)):
        t.seconds[(phase, 1, width, False)] = s
    return t


ONE = Counter({GREEDY: 1})   # a round's rows by sampler setting: one greedy row
T1 = (1.0, 1.0, 0)   # the sampler setting of temperature 1, no filter


def _milli(xs) -> list[int]:
    return [int(round(x * PRED_SCALE)) for x in xs]


def _seen(xs, budget: int, budgets=(4, 8, 16, 31)) -> list[int]:
    """What a round at `budget` observes: the expected τ at the budgets up to it, 0 past it."""
    return [m if b <= budget else 0 for m, b in zip(_milli(xs), budgets)]


def _chooser(preds: list[float]) -> BudgetChooser:
    """A chooser whose drafter's predictions (τ at budgets 4, 8, 16, 31) were seen right: calibration 1."""
    t = _table()
    c = BudgetChooser(t, t.spec.budgets)
    c.observe(GREEDY, _milli(preds), _milli(preds))
    return c


_calibrated = _chooser


def test_chooser_takes_the_most_tokens_per_second():
    t = _table()
    assert t.spec.budgets == (4, 8, 16, 31)
    assert t.round_seconds(1, 0) == pytest.approx(1.0 + 1.26 / 63) and t.round_seconds(1, 8) == pytest.approx(1.7)
    allowed = t.spec.budgets_at(1)
    # tokens/s: 0 -> 0.98, 4 -> 2.0/1.5 = 1.33, 8 -> 2.5/1.7 = 1.47, 16 -> 2.8/2.1 = 1.33, 31 -> 3/3 = 1
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    assert c.choose(1, allowed, ONE) == 8
    assert c.choose(1, allowed, ONE, cap=4) == 4 and c.choose(1, allowed, ONE, cap=0) == 0
    assert c.choose(1, allowed, ONE, cap=20) == 8
    # a drafter the target rarely follows: plain decoding, with a probe at the best drafting budget
    # (4 here) as often as keeps its loss within PROBE_SHARE: 1.5 s for 1.1 tokens that plain
    # rounds commit in 1.1 * 1.02 s
    c = _calibrated([1.1, 1.15, 1.2, 1.25])
    every = math.ceil((1.5 - 1.1 * 1.02) / (PROBE_SHARE * 1.02))
    assert every == 38
    picks, probed = [], []
    for _ in range(3 * every):
        picks.append(c.choose(1, allowed, ONE))
        probed.append(c.probed)
    assert picks == ([0] * (every - 1) + [4]) * 3
    assert probed == [b > 0 for b in picks]   # each drafting round here a probe
    assert c.choose(1, allowed, ONE, cap=20) == 0 and not c.probed
    # one further below plain is probed less often, one that never pays at most every PROBE_MAX
    c = _calibrated([1.02, 1.03, 1.04, 1.05])
    assert [c.choose(1, allowed, ONE) for _ in range(46)] == [0] * 45 + [4]   # (1.5 - 1.0404) / 0.0102
    c = _calibrated([1.0, 1.0, 1.0, 1.0])
    for width in (5, 9, 17, 32):
        c.costs.seconds[(Phase.VERIFY, 1, width, False)] *= 10
    picks = [c.choose(1, allowed, ONE) for _ in range(PROBE_MAX)]
    assert picks == [0] * (PROBE_MAX - 1) + [4]
    # no prediction yet for a sampled row: draft at the largest budget to get one
    assert c.choose(1, allowed, Counter({GREEDY: 1, T1: 1})) == 31


def test_a_probe_weighs_the_rounds_it_was_stale_for():
    """After a plain stretch the drafter turns right: a probe's observation weighs more than one
    round's (the filter's gain after n rounds), so drafting wins back after one probe."""
    allowed = _table().spec.budgets_at(1)
    c = _calibrated([1.1, 1.15, 1.2, 1.25])
    right = [int(p * PRED_SCALE) for p in (2.0, 2.5, 2.8, 3.0)]
    picks = []
    while len(picks) < 200 and picks[-2:] != [8, 8]:
        b = c.choose(1, allowed, ONE)
        picks.append(b)
        if b:
            c.observe(GREEDY, right, _seen((2.0, 3.0, 3.0, 3.0), b))
    assert picks[-2:] == [8, 8] and sum(b > 0 for b in picks) == 3, picks   # one probe, then 8
    assert c.cal[GREEDY].var < 0.3   # consecutive rounds bring the gain back toward EMA
    # consecutive drafting rounds weigh by the filter's gain: about a half after the drafter's own
    # prediction (which stands as one observation), then falling toward EMA
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    var, want, gains = 1.0, 2.5, []
    for k in range(4):
        var += DRIFT
        var = var / (var + 1)
        gains.append(var)
        want += var * ((2.5 if k == 0 else 1.5) - want)
    for _ in range(3):
        c.choose(1, allowed, ONE)
        c.observe(GREEDY, _milli((1.0, 1.5, 1.5, 1.5)), _seen((1.0, 2.0, 2.0, 2.0), 8))
    assert c.cal[GREEDY].pred[1] == pytest.approx(want, abs=0.01)
    assert gains[0] == pytest.approx(0.5, abs=0.01) and gains[0] > gains[1] > gains[2] > gains[3] > EMA


def test_draft_margin_gives_near_ties_to_the_largest_budget(monkeypatch):
    import drafttree.engine.budget as budget_module

    allowed = _table().spec.budgets_at(1)
    # tokens/s: 8 -> 2.5/1.7 = 1.471, 16 -> 3.05/2.1 = 1.452 (1.3 % below), 31 -> 4.3/3 = 1.433 (2.5 % below)
    preds = [2.0, 2.5, 3.05, 4.3]
    assert budget_module.DRAFT_MARGIN == 0 and _chooser(preds).choose(1, allowed, ONE) == 8
    monkeypatch.setattr(budget_module, "DRAFT_MARGIN", 0.02)
    assert _chooser(preds).choose(1, allowed, ONE) == 16
    monkeypatch.setattr(budget_module, "DRAFT_MARGIN", 0.05)
    assert _chooser(preds).choose(1, allowed, ONE) == 31
    # over 16 rows the margin is a quarter (1.25 %): 16's 1.3 % is no longer a tie
    assert _chooser(preds).choose(1, allowed, Counter({GREEDY: 16})) == 8
    monkeypatch.setattr(budget_module, "DRAFT_MARGIN", 0.11)
    assert _chooser(preds).choose(1, allowed, Counter({GREEDY: 16})) == 31
    # plain decoding still wins where it beats the best drafting rate, and its probe takes the
    # margin: 8's 0.676 is 7.8 % below 4's 0.733
    monkeypatch.setattr(budget_module, "DRAFT_MARGIN", 0.05)
    c = _calibrated([1.1, 1.15, 1.2, 1.25])
    assert c.choose(1, allowed, ONE) == 0 and c._kept[3] == 4


def test_a_probe_drafts_at_the_budget_the_estimate_ranks_best():
    """Where a wide verify costs little more than a narrow one (a GPU at batch 1), the probe
    drafts at the largest budget, not the smallest."""
    t = _table()
    for width, s in ((5, 1.0), (9, 1.02), (17, 1.05), (32, 1.1)):
        t.seconds[(Phase.VERIFY, 1, width, False)] = s
    c = BudgetChooser(t, t.spec.budgets)
    preds = [1.1, 1.2, 1.3, 1.5]
    c.observe(GREEDY, _milli(preds), _milli(preds))   # calibration 1
    # budget 31: 1.5 tokens in 1.6 s, which plain rounds commit in 1.53 s: (1.6 - 1.53) / 0.0102
    # rounds per probe, rounded up
    picks = [c.choose(1, t.spec.budgets_at(1), ONE) for _ in range(14)]
    assert picks == ([0] * 6 + [31]) * 2


def test_calibration_follows_observed_acceptance():
    allowed = _table().spec.budgets_at(1)
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    assert c.choose(1, allowed, ONE) == 8
    for i in range(60):    # a third of the drafted tokens predicted at budget 8 (1.5) accepted
        c.observe(GREEDY, _milli((2.0, 2.5, 2.8, 3.0)), _seen((1.3, 1 + i % 2, 0, 0), 8))
    cal = c.cal[GREEDY]
    assert cal.ratio(1) == pytest.approx(1 / 3, rel=0.15) and cal.ratio(0) == pytest.approx(0.3, rel=0.02)
    # budgets past those verified follow the largest verified
    assert c.cal[GREEDY].ratio(3) == pytest.approx(c.cal[GREEDY].ratio(1), rel=0.1)
    assert c.choose(1, allowed, ONE) == 0


def test_observed_round_times_correct_the_table():
    """Rounds at budget 8 that take three times what the table says: plain decoding wins; and
    sampled rounds price the sampled pick where it was timed."""
    allowed = _table().spec.budgets_at(1)
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    for _ in range(40):
        c.observe_round(1, 8, False, 3 * 1.7)
        c.observe_round(1, 4, False, 3 * 1.5)
        c.observe_round(1, 16, False, 3 * 2.1)
        c.observe_round(1, 31, False, 3 * 3.0)
        c.observe_round(1, 0, False, 1.0 + 1.26 / 63)   # decode steps as timed
    assert c.cost_ratio[(1, True, False, ())] == pytest.approx(3.0, rel=0.05)
    assert c.choose(1, allowed, ONE) == 0
    # a machine three times slower than at start-up in every round drafted: the decode step, never
    # observed, is priced by the rounds that were, so drafting at 8 still wins
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    for _ in range(40):
        c.observe_round(1, 8, False, 3 * 1.7)
    assert c.any_ratio == pytest.approx(3.0, rel=0.05) and c.choose(1, allowed, ONE) == 8
    # ... and after PLAIN_STALE rounds without a plain one, one round decodes to price them
    assert [c.choose(1, allowed, ONE) for _ in range(PLAIN_STALE)] == [8] * (PLAIN_STALE - 1) + [0]
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    c.costs.seconds[(Phase.VERIFY, 1, 9, True)] = 10.0      # a costly sampled pick at width 9
    assert c.costs.round_seconds(1, 8, sampled=True) == pytest.approx(10.5)
    assert c.costs.round_seconds(1, 4, sampled=True) == pytest.approx(1.5)   # untimed: the greedy entry


def test_constrained_rounds_are_priced_as_their_own_kind():
    """Drafting rounds with structured-output rows that take three times their table cost (the
    host grows their trees and masks): constrained rounds decode plainly, free rounds still draft
    (their kind is not moved), and a constrained kind not yet observed starts from its free twin's."""
    allowed = _table().spec.budgets_at(1)
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    for _ in range(40):
        c.observe_round(1, 8, False, 1.7)                        # free drafting rounds as timed
        c.observe_round(1, 8, False, 3 * 1.7, extra=("constrained",))
        c.observe_round(1, 0, False, 1.0 + 1.26 / 63, extra=("constrained",))
    assert c.cost_ratio[(1, True, False, ("constrained",))] == pytest.approx(3.0, rel=0.05)
    assert c.any_ratio == pytest.approx(1.0, rel=0.02)           # free rounds' fallback untouched
    assert c.round_seconds(1, 8, False, extra=("constrained",)) == pytest.approx(3 * c.round_seconds(1, 8, False), rel=0.05)
    assert c.choose(1, allowed, ONE, extra=("constrained",)) == 0
    assert c.choose(1, allowed, ONE) == 8
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    for _ in range(40):
        c.observe_round(1, 8, False, 2 * 1.7)
    assert c.round_seconds(1, 8, False, extra=("constrained",)) == pytest.approx(c.round_seconds(1, 8, False))


def test_a_constrained_rounds_host_time_is_priced_per_node():
    """Constrained rounds at budget 31 whose host grows trees for 0.1 s a node (3.1 s a round on top
    of the table's 3.0): the host time is priced per drafted node, apart from the device's ratio, so
    budget 4 (0.4 s of trees) still beats plain decoding where one ratio for every budget (2x)
    would have priced every drafting round out."""
    allowed = _table().spec.budgets_at(1)
    c = _chooser([2.0, 2.5, 2.8, 3.0])
    con = ("constrained",)
    for _ in range(40):
        c.observe_round(1, 31, False, 3.0 + 3.1, extra=con, host_s=3.1, host_rows=1)
        c.observe_round(1, 0, False, 1.0 + 1.26 / 63, extra=con)
    assert c.host_node[con] == pytest.approx(0.1)
    assert c.cost_ratio[(1, True, False, con)] == pytest.approx(1.0, rel=0.02)
    assert c.round_seconds(1, 4, False, extra=con) == pytest.approx(c.round_seconds(1, 4, False) + 0.4, rel=0.02)
    assert c.round_seconds(1, 4, False, extra=con, host_rows=2) == pytest.approx(c.round_seconds(1, 4, False) + 0.8,
                                                                             rel=0.02)
    assert c.choose(1, allowed, ONE, extra=con) == 4
    assert c.choose(1, allowed, ONE) == 8                        # free rounds: no host time
    assert () not in c.host_node


def test_one_slow_round_does_not_price_its_budget_out():
    """A host pause makes one round at budget 31 take ten times its cost: the choice stays at 31
    (drafting rounds share one ratio, and a round moves it by at most a factor of 2 at EMA's
    weight), and normal rounds bring the ratio back."""
    t = _table()
    for width, s in ((5, 1.0), (9, 1.02), (17, 1.05), (32, 1.1)):
        t.seconds[(Phase.VERIFY, 1, width, False)] = s
    c = BudgetChooser(t, t.spec.budgets)
    c.observe(GREEDY, _milli((2.0, 2.6, 3.0, 3.3)), _milli((2.0, 2.6, 3.0, 3.3)))
    allowed = t.spec.budgets_at(1)
    assert c.choose(1, allowed, ONE) == 31
    c.observe_round(1, 0, False, t.round_seconds(1, 0))   # plain rounds priced as timed
    c.observe_round(1, 31, False, 10 * t.round_seconds(1, 31))
    assert c.cost_ratio[(1, True, False, ())] == pytest.approx(1.1)
    for _ in range(20):
        b = c.choose(1, allowed, ONE)
        assert b == 31
        c.observe_round(1, b, False, t.round_seconds(1, b))
    assert c.cost_ratio[(1, True, False, ())] == pytest.approx(1.0, abs=0.02)


def test_a_plain_price_a_passing_load_raised_is_observed_again():
    """Drafting loses (T = 1 on a CPU); plain rounds run five times slower for a while (another
    process), which prices them up while drafting, priced by its own rounds, looks cheaper: the
    choice drafts, and plain rounds, no longer run, would never be priced back down. A plain
    round every PLAIN_STALE drafting rounds observes them again, and the choice returns to plain."""
    t = _table()
    c = _calibrated([1.1, 1.15, 1.2, 1.25])
    allowed = t.spec.budgets_at(1)
    c.observe_round(1, 4, False, t.round_seconds(1, 4))
    picks = []
    for i in range(600):
        b = c.choose(1, allowed, ONE)
        picks.append(b)
        c.observe_round(1, b, False, (5 if b == 0 and i < 60 else 1) * t.round_seconds(1, b))
    late = picks[60:]
    assert any(late[:PLAIN_STALE]) and late[-100:].count(0) >= 95, late


def _simulate(scale: float, seed: int, rounds: int = 3000) -> float:
    """Tokens per second over plain decoding's, of the chooser on a GPU-like table at batch 1
    (plain 0.52, a drafting round 1.1-1.2 time units: break-even at τ 2.3 for budget 31) against a
    drafter whose rounds accept geometric τ of mean `scale` x (2.4, 2.8, 3.1, 3.3) at budgets
    (4, 8, 16, 31) and predict (2.6, 3.0, 3.3, 3.6); each round is read one round late (overlap)."""
    import random
    t = _table()
    t.seconds.update({(Phase.DECODE, 1, 1, False): 0.5, (Phase.DRAFT, 1, 16, False): 0.5})
    for width, sec in ((5, 0.6), (9, 0.62), (17, 0.66), (32, 0.7)):
        t.seconds[(Phase.VERIFY, 1, width, False)] = sec
    c, rng, allowed = BudgetChooser(t, t.spec.budgets), random.Random(seed), t.spec.budgets_at(1)
    preds = [int(p * PRED_SCALE) for p in (2.6, 3.0, 3.3, 3.6)]
    tokens, seconds, unread = 0, 0.0, None
    for _ in range(rounds):
        b = c.choose(1, allowed, ONE)
        seconds += t.round_seconds(1, b)
        tau = 1
        if b:
            stop = 1 / (scale * {4: 2.4, 8: 2.8, 16: 3.1, 31: 3.3}[b])
            while rng.random() > stop and tau < 16:
                tau += 1
        tokens += tau
        if unread is not None and unread[0]:
            c.observe(GREEDY, preds, _seen([scale * x for x in (2.4, 2.8, 3.1, 3.3)], unread[0]))
        unread = (b, tau)
    return tokens / seconds * t.round_seconds(1, 0)


def test_the_choice_drafts_where_it_pays_and_loses_little_where_it_does_not():
    """Noisy acceptance above break-even: near fixed budget 31's 1.43x (a choice that let a stale
    estimate keep it plain got 1.00-1.37x on these seeds). Below break-even (τ 2.0 at 31): within
    the probes' 2 % (and the estimate's noise) of plain decoding."""
    above = [_simulate(1.0, seed) for seed in range(3)]
    assert min(above) > 1.3 and sum(above) / 3 > 1.38, above
    below = [_simulate(0.6, seed) for seed in range(3)]
    assert min(below) > 0.97, below


def test_fixed_spec_takes_its_largest_budget():
    spec = SpecConfig("ddtree", block_size=8, budget=24)
    c = BudgetChooser(None, spec.budgets, adaptive=False)
    assert c.choose(1, spec.budgets_at(1), ONE) == 24 and c.choose(1, spec.budgets_at(1), ONE, cap=7) == 0


def _forced(llm: LLM, pattern: list[int]) -> list[int]:
    """Make the engine's chooser cycle through `pattern` (each entry taken if the round may run
    at it, else 0); returns the budgets chosen."""
    chooser, chosen, i = llm.engine.chooser, [], itertools.count()

    def choose(bucket, allowed, rows, cap=None, extra=(), host_rows=0):
        want = pattern[next(i) % len(pattern)]
        b = want if want in allowed and (cap is None or want <= cap) else 0
        chosen.append(b)
        return b
    chooser.choose = choose
    return chosen


PATTERN = [0, 4, 0, 0, 32, 8, 16, 3, 0, 4, 32, 32, 0]


@pytest.mark.parametrize("shape", ["llama", "qwen3"])
@pytest.mark.parametrize("spec", ["ddtree", "dflash"])
@pytest.mark.parametrize("overlap", [False, True])
def test_budget_changes_between_rounds_are_lossless(zoo, shape, spec, overlap):
    pair = zoo(shape)
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec=spec, device="cpu", dtype="float32",
              max_num_seqs=3, max_model_len=128, overlap=overlap)
    assert llm.engine.spec.adaptive and llm.engine.costs is not None
    chosen = _forced(llm, PATTERN)
    prompts = make_prompts(pair.vocab)
    outs = llm.generate(prompts, [greedy(n) for n in (40, 33, 27)])
    for p, n, out in zip(prompts, (40, 33, 27), outs):
        assert out.token_ids == pair.plain(p, n)
    used = set(chosen)
    assert 0 in used and len(used) >= (3 if spec == "ddtree" else 2), chosen
    assert dict(llm.engine.stats.budget_hist).keys() <= set(PATTERN) | {0}


@pytest.mark.parametrize("spec", ["ddtree", "dflash"])
def test_budget_changes_keep_seeded_sampling(zoo, spec):
    """At T > 0 the same seed gives plain decoding's tokens whatever budget each round ran at."""
    pair = zoo("llama")
    prompts = make_prompts(pair.vocab)
    sp = [SamplingParams(temperature=T, seed=7 + i, max_tokens=30, ignore_eos=True)
          for i, T in enumerate((0.9, 1.0, 0.0))]
    plain = LLM(model=str(pair.target), device="cpu", dtype="float32", max_num_seqs=3, max_model_len=128)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec=spec, device="cpu", dtype="float32",
              max_num_seqs=3, max_model_len=128)
    chosen = _forced(llm, PATTERN)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert 0 in chosen and any(chosen)


def test_the_real_chooser_is_lossless_and_reports_its_budgets(zoo):
    pair = zoo("llama")
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", device="cpu",
              dtype="float32", max_num_seqs=3, max_model_len=128)
    prompts = make_prompts(pair.vocab)
    outs = llm.generate(prompts, greedy(40))
    assert [o.token_ids for o in outs] == [pair.plain(p) for p in prompts]
    st = llm.engine.stats
    assert sum(st.budget_hist.values()) == st.rounds and st.budget_hist.keys() <= {0, 4, 8, 16, 32}
    assert sum(st.method_rounds.values()) == st.rounds
    assert llm.engine.chooser.cal[GREEDY].pred is not None   # at least the first round drafted


@pytest.mark.parametrize("overlap", [False, True])
def test_round_times_are_observed_with_and_without_overlap(zoo, overlap):
    """Every round's seconds reach the chooser (overlapped rounds timed read to read), except an
    overlapped one whose interval held a prefill: a request that arrived while it ran."""
    pair = zoo("llama")
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", device="cpu",
              dtype="float32", max_num_seqs=3, max_model_len=128, overlap=overlap)
    eng, seen = llm.engine, []
    observe = eng.chooser.observe_round
    eng.chooser.observe_round = lambda *a: seen.append(a) or observe(*a)
    prompts = make_prompts(pair.vocab)
    first = eng.add_request(prompts[0], greedy(30))
    for _ in range(4):
        eng.step()
    rounds = eng.stats.rounds
    late = eng.add_request(prompts[1], greedy(12))
    eng.step()   # the late request's prefill, then a round; with overlap the read is the round before
    assert eng.stats.rounds == rounds + 1
    while eng.has_unfinished():
        eng.step()
    assert first.output_ids == pair.plain(prompts[0], 30) and late.output_ids == pair.plain(prompts[1], 12)
    assert all(a[3] > 0 for a in seen) and eng.chooser.cost_ratio
    assert len(seen) == eng.stats.rounds - (1 if overlap else 0)


def test_max_budget_caps_the_rounds_a_request_is_in(zoo):
    """The batch shares one width: a round verifies at most its rows' smallest max_budget; a
    request at 0 makes the rounds it is in decode plainly. Plain decoding's tokens throughout."""
    pair = zoo("llama")
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", budget=32, device="cpu",
              dtype="float32", max_num_seqs=3, max_model_len=128)
    runner, budgets = llm.engine.runner, []
    run_round = runner.run_round
    runner.run_round = lambda B, mode, n, b=None, **kw: budgets.append((B, b)) or run_round(B, mode, n, b, **kw)
    prompts = make_prompts(pair.vocab)
    with pytest.raises(ValueError, match="max_budget"):
        SamplingParams(max_budget=-1)
    # a request capped at 0 that finishes first: its rounds decode, then the other two draft
    sp = [greedy(10, max_budget=0), greedy(40), greedy(40)]
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [pair.plain(p, n) for p, n in zip(prompts, (10, 40, 40))]
    assert all(b == 0 for B, b in budgets if B == 3) and any(b == 32 for B, b in budgets if B < 3)
    # a cap below the fixed budget decodes plainly (no smaller tree was captured)
    budgets.clear()
    outs = llm.generate(prompts[:1], [greedy(20, max_budget=8)])
    assert outs[0].token_ids == pair.plain(prompts[0], 20) and {b for _, b in budgets} == {0}
    # adaptive: the cap bounds the choice
    auto = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", device="cpu",
               dtype="float32", max_num_seqs=3, max_model_len=128)
    chosen = _forced(auto, [32, 16, 8, 4])
    outs = auto.generate(prompts, [greedy(40, max_budget=8), greedy(20), greedy(20)])   # the capped one last
    assert [o.token_ids for o in outs] == [pair.plain(p, n) for p, n in zip(prompts, (40, 20, 20))]
    assert set(chosen) <= {0, 4, 8} and {4, 8} <= set(chosen)


def test_graphs_prints_the_measured_cost_model(zoo, capsys):
    from drafttree.cli import main
    pair = zoo("llama")
    assert main(["graphs", "--model", str(pair.target), "--draft-model", str(pair.drafter), "--device", "cpu",
                 "--max-num-seqs", "2", "--max-model-len", "128", "--costs"]) == 0
    out = capsys.readouterr().out
    assert "budget=auto(<=32: 4,8,16,32)" in out and "cost model (" in out
    table = out[out.index("cost model ("):]   # the graph plan above it has rows of the same phases
    rows = [line.split() for line in table.splitlines() if line.startswith(("decode ", "verify ", "draft ", "context "))]
    timed = {(r[0], int(r[1]), int(r[2]), r[3]): r for r in rows if len(r) == 7}
    assert {("verify", b, w, "greedy") for b in (1, 2) for w in (5, 9, 17, 33)} <= timed.keys()
    assert ("decode", 2, 1, "sampled") in timed and ("context", 1, 16, "greedy") in timed
    # each timed entry's spread (the median's relative standard error) and its runs
    for r in timed.values():
        assert r[5].startswith("+-") and r[5].endswith("%") and cost.CPU_REPS <= int(r[6]) <= cost.CPU_MAX_REPS, r
