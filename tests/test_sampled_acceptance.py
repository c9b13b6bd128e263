"""The acceptance the budget choice learns from at T > 0: what the target's own sampler gives a
verified tree (`acceptance.observed_accept`) against Monte Carlo over the seeded sampler and the
tree walk, in the engine against the accepted lengths its rounds realise, and the chooser's
calibration kept per sampler setting."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.engine.budget import GREEDY, BudgetChooser, sampler_key
from drafttree.phases import Phase, SpecConfig
from drafttree.runner.cost import CostTable
from drafttree.sampling import SampleMode, SamplingTensors, pick_tokens
from drafttree.spec_decode.acceptance import PRED_SCALE, observed_accept, observed_at
from drafttree.spec_decode.tree import accept, build_tree
from tests.tiny import make_drafter, make_target

V, D, BUDGET = 5, 3, 8


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.randn(1, D, V, generator=g) * 2, torch.zeros(1, dtype=torch.long), BUDGET)
    logits = torch.randn(1, BUDGET + 1, V, generator=g) * 2   # the target's at every node
    return tree, logits


@pytest.mark.parametrize("mode,temp,top_k,top_p", [(SampleMode.SAMPLE, 0.8, 0, 1.0),
                                                   (SampleMode.FILTERED, 1.0, 3, 0.8)])
def test_observed_accept_is_the_samplers_acceptance(mode, temp, top_k, top_p):
    """Column b is E[τ] of the tree's first b + 1 nodes under the seeded sampler (Gumbel noise of
    seed, position and token; top-k and top-p): the mean of the walk over 6,000 seeds."""
    tree, logits = _case(0)
    R = 6000
    st = SamplingTensors(torch.full((R,), temp), torch.full((R,), top_p), torch.full((R,), top_k),
                         torch.arange(R))
    many = type(tree)(*(t.expand(R, *t.shape[1:]) for t in (tree.tokens, tree.parents, tree.depth, tree.valid,
                                                            tree.visible)))
    pos = 10 + many.depth + 1
    picks = pick_tokens(logits.expand(R, -1, -1), st, pos, mode)
    got = observed_accept(logits.expand(R, -1, -1), many, picks, st, mode)[0]
    for b in (1, 2, 4, BUDGET):
        tau = accept(many.first(b + 1), picks[:, :b + 1], D).accept_len.float()
        se = tau.std().item() / R ** 0.5
        assert got[b].item() == pytest.approx(tau.mean().item(), abs=4 * se + 1e-3), b
    assert torch.all(got[1:] >= got[:-1]) and got[0] == 1.0


def test_a_greedy_rows_observation_is_its_walk():
    """At T = 0 (and for a greedy row in a sampled batch) each column is the realised τ of the
    tree's first columns; budgets past the verified one read 0."""
    tree, logits = _case(1)
    picks = logits.argmax(-1)
    picks[0, 0] = tree.tokens[0, 1]   # the root's pick is the first node's token: a walk of at least 2
    st = SamplingTensors.empty(1, "cpu")
    for mode in (SampleMode.GREEDY, SampleMode.SAMPLE):
        got = observed_accept(logits, tree, picks, st, mode)[0]
        for b in range(BUDGET + 1):
            assert got[b].item() == accept(tree.first(b + 1), picks[:, :b + 1], D).accept_len.item()
    assert observed_at(got[None], (2, 8, 16)).tolist() == [[round(got[2].item() * PRED_SCALE),
                                                           round(got[8].item() * PRED_SCALE), 0]]


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """Six tokens: a random drafter's tokens are accepted often enough at T = 1 to measure."""
    root = tmp_path_factory.mktemp("acceptance")
    target = make_target(root / "target", "llama", vocab=6)
    return target, make_drafter(root / "drafter", target, block_size=4)


def test_the_engine_observes_what_its_sampler_accepts(small_vocab_pair):
    """Drafting rounds at T = 1: the mean of what the rounds observed at the budget verified is the
    mean accepted length they realised (within its standard error), and the chooser's calibrated
    expectation at that budget follows it."""
    t, d = small_vocab_pair
    llm = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget="auto", device="cpu", dtype="float32",
              max_num_seqs=4, max_model_len=256)
    eng = llm.engine
    budget = max(eng.spec.budgets)
    eng.chooser.choose = lambda bucket, allowed, rows, cap=None, extra=(), host_rows=0: budget
    seen, observe = [], eng.chooser.observe
    eng.chooser.observe = lambda key, preds, s: seen.append((key, s)) or observe(key, preds, s)
    sp = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, ignore_eos=True) for i in range(4)]
    outs = llm.generate([[1, 2, 3], [3, 1], [2, 2, 5], [4]], sp)
    taus = torch.tensor([float(k) for o in outs for k in o.metrics["accept_lengths"][:-1]])   # the last is cut short
    i = eng.spec.budgets.index(budget)
    assert {k for k, _ in seen} == {(1.0, 1.0, 0)} and len(seen) >= 30
    mean_seen = sum(s[i] for _, s in seen) / len(seen) / PRED_SCALE
    se = taus.std().item() / len(taus) ** 0.5
    assert 1.2 < taus.mean().item() and mean_seen == pytest.approx(taus.mean().item(), abs=4 * se), (mean_seen, se)
    cal = eng.chooser.cal[(1.0, 1.0, 0)]
    assert cal.expected(i) == pytest.approx(1 + cal.observed[i], rel=0.02)


def _table() -> CostTable:
    spec = SpecConfig("ddtree", block_size=16, budget=31, adaptive=True)
    t = CostTable(spec)
    for phase, width, s in ((Phase.DECODE, 1, 1.0), (Phase.CONTEXT, 64, 0.63), (Phase.DRAFT, 16, 1.5),
                            (Phase.VERIFY, 5, 0.6), (Phase.VERIFY, 9, 0.62), (Phase.VERIFY, 17, 0.66),
                            (Phase.VERIFY, 32, 0.7)):
        t.seconds[(phase, 1, width, False)] = s
    return t


def test_sampler_settings_are_calibrated_apart():
    """The same drafter predictions, seen right at T = 0.3 and at a third of their drafted tokens
    at T = 1: rounds of T = 0.3 draft, rounds of T = 1 decode; a setting not seen yet starts from
    the pooled sampled calibration; a batch mixing them weighs each row by its own."""
    t = _table()
    c = BudgetChooser(t, t.spec.budgets)
    preds = [int(p * PRED_SCALE) for p in (2.5, 3.0, 3.3, 3.5)]
    warm, hot = (0.3, 1.0, 0), (1.0, 1.0, 0)
    assert sampler_key(SamplingParams(temperature=0.3)) == warm and sampler_key(SamplingParams(temperature=0)) == GREEDY
    assert sampler_key(SamplingParams(temperature=1.0, top_k=5, top_p=0.9)) == (1.0, 0.9, 5)
    for _ in range(60):
        c.observe(warm, preds, preds)
        c.observe(hot, preds, [int((1 + (p / PRED_SCALE - 1) / 3) * PRED_SCALE) for p in preds])
    allowed = t.spec.budgets_at(1, greedy=False)
    assert c.choose(1, allowed, Counter({warm: 1})) > 0
    assert c.choose(1, allowed, Counter({hot: 1})) == 0
    assert c.cal[hot].expected(3) == pytest.approx(1 + 2.5 / 3, rel=0.01)
    assert c.cal[warm].expected(3) == pytest.approx(3.5, rel=0.01)
    pooled = c.calibration((0.7, 1.0, 0))
    assert pooled is c.pooled[False] and c.cal[hot].expected(3) < pooled.expected(3) < c.cal[warm].expected(3)
    mixed = c.expected_tokens(31, Counter({warm: 1, hot: 1}))
    assert mixed == pytest.approx(c.cal[warm].expected(3) + c.cal[hot].expected(3))
    assert c.calibration(GREEDY) is None   # nothing greedy seen: a greedy row drafts to learn


@pytest.mark.skipif(not any(map(__import__("shutil").which, ("cc", "gcc"))), reason="compiling on CPU needs a C compiler")
def test_compiled_predictions_and_observations_match_the_definitions(set_settings):
    """What a drafting round writes for the budget choice (`predicted`, `observed`: the acceptance
    model and the target's acceptance compiled into a few kernels) equals the readable definitions
    (`expected_accept`, `observed_accept`) read at the budgets, greedy and sampled rows alike."""
    from drafttree.spec_decode.acceptance import expected_accept, observed, predicted, predictions_at
    g = torch.Generator().manual_seed(3)
    R, budgets = 3, (2, 4, 8, 16)
    draft = torch.randn(R, D, V, generator=g) * 2
    tree = build_tree(draft, torch.zeros(R, dtype=torch.long), BUDGET)
    logits = torch.randn(R, BUDGET + 1, V, generator=g) * 2
    st = SamplingTensors(torch.tensor([0.0, 0.7, 1.0]), torch.tensor([1.0, 0.9, 1.0]), torch.tensor([0, 0, 3]),
                         torch.arange(R))
    cases = [(SampleMode.GREEDY, logits.argmax(-1))]
    for mode in (SampleMode.SAMPLE, SampleMode.FILTERED):
        cases.append((mode, pick_tokens(logits, st, 10 + tree.depth + 1, mode)))
    want_pred = predictions_at(expected_accept(draft, tree), budgets)
    want_seen = [observed_at(observed_accept(logits, tree, picks, st, mode), budgets) for mode, picks in cases]
    for compile_mode in ("0", "cpu"):
        set_settings(compile=compile_mode)
        assert torch.equal(predicted(draft, tree, budgets), want_pred), compile_mode
        for (mode, picks), want in zip(cases, want_seen):
            got = observed(logits, tree, picks, st, mode, None, budgets)
            assert (got - want).abs().max().item() <= 1, (compile_mode, mode)   # in 1/PRED_SCALE tokens
    assert want_pred[:, -1].min().item() > PRED_SCALE   # a tree of 8 nodes predicts more than the root
