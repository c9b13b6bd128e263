"""Every width follows `SpecConfig.width(phase, batch)`: changing the budget, its schedule or the
block size changes, together, the graph plan's widths, the tree builder's output, the verify
mask, the KV headroom and the runner's buffers. The expected figures are written out by hand
(the seed's configuration first: block 8, budget 32 -> verify 33, draft 8)."""
from __future__ import annotations

import pytest
import torch

from drafttree.config import ModelConfig
from drafttree.models.random_shapes import drafter_for, random_model
from drafttree.phases import CONTEXT_ROUNDS, Phase, SpecConfig
from drafttree.runner.cuda_graph import graph_plan
from drafttree.runner.model_runner import CacheConfig, ModelRunner
from drafttree.runner.phase_table import bucket_steps, check_widths
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.spec_decode import rounds
from drafttree.spec_decode.tree import build_tree

ROWS = 4                 # batch buckets 1, 2, 4
MAX_LEN = 64
TARGET = ModelConfig(arch="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)

# (method, block_size, budget, schedule) -> verify width per batch bucket, draft width, KV headroom,
# tokens a round commits at most (the pending-feature and output buffers' width)
CASES = {
    "seed: block 8, budget 32": (("ddtree", 8, 32, ()), {1: 33, 2: 33, 4: 33}, 8, 33, 8),
    "budget 16": (("ddtree", 8, 16, ()), {1: 17, 2: 17, 4: 17}, 8, 17, 8),
    "budget 4: the draft is wider than the tree": (("ddtree", 8, 4, ()), {1: 5, 2: 5, 4: 5}, 8, 8, 8),
    "block 4": (("ddtree", 4, 32, ()), {1: 33, 2: 33, 4: 33}, 4, 33, 4),
    "block 16, budget 31, schedule 2:4": (("ddtree", 16, 31, ((2, 4),)), {1: 32, 2: 5, 4: 5}, 16, 32, 16),
    "schedule 4:12 above budget 8": (("ddtree", 8, 8, ((4, 12),)), {1: 9, 2: 9, 4: 13}, 8, 13, 8),
    "dflash, block 8": (("dflash", 8, 0, ()), {1: 8, 2: 8, 4: 8}, 8, 8, 8),
}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return random_model(TARGET, torch.device("cpu"), torch.float32)


def make_runner(target, spec: SpecConfig) -> ModelRunner:
    drafter = drafter_for(target, torch.device("cpu"), torch.float32, spec.block_size, layers=1,
                          layer_ids=(0, 1))
    cache = CacheConfig(ROWS, MAX_LEN, spec.kv_headroom)
    runner = ModelRunner(target, drafter, spec, cache, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (5, 9, 7, 6)]
    runner.prefill_rows(prompts, [SamplingParams(temperature=0.0)] * ROWS, list(range(ROWS)))
    return runner


@pytest.mark.parametrize("case", list(CASES))
def test_every_width_follows_the_spec(target, monkeypatch, case):
    args, verify, draft, headroom, commit = CASES[case]
    spec = SpecConfig(*args)
    assert {b: spec.width(Phase.VERIFY, b) for b in verify} == verify
    assert spec.width(Phase.DRAFT) == draft and spec.kv_headroom == headroom and spec.max_commit == commit

    runner = make_runner(target, spec)

    # the graph plan (what capture would capture), without a GPU
    plan = graph_plan(spec, TARGET, runner.drafter.cfg.model, ROWS, [1024])
    planned = {(e.phase, b): e.width for e in plan for b in e.batch_sizes}
    assert {b: planned[(Phase.VERIFY, b)] for b in verify} == verify
    assert {planned[(Phase.DRAFT, b)] for b in verify} == {draft}

    # the runner's buffers and caches
    s = runner.state
    assert s.ctx_feat.shape[1] == spec.width(Phase.CONTEXT) == CONTEXT_ROUNDS * commit
    assert s.out_tokens.shape[1] == commit
    assert s.block_table.shape[1] * runner.kv.page_size >= MAX_LEN + headroom
    assert runner.kv.num_pages == runner.dkv.num_pages == runner.cache_cfg.num_pages

    # the tree builder's output and the verify mask, in the round functions, per batch bucket
    masks = []
    real_meta = rounds.attn_meta
    monkeypatch.setattr(rounds, "attn_meta", lambda start, intra, kv_len, *a, **kw:
                        masks.append(intra.shape) or real_meta(start, intra, kv_len, *a, **kw))
    rc, kv_len = runner.round_ctx, runner.round_kv_len(9)
    assert s.tree.num_nodes == max(verify.values())   # the tree buffers: the widest verify
    for B, bucket in ((1, 1), (2, 2), (3, 4)):
        masks.clear()
        tree = rounds.draft_phase(rc, B, kv_len)
        assert tree.tokens.shape == tree.depth.shape == (B, verify[bucket])
        assert masks == [(B, draft, draft)]          # the draft block sees all of itself
        masks.clear()
        rounds.verify_forward(rc, B, kv_len, tree, SampleMode.GREEDY)
        assert masks == [(B, verify[bucket], verify[bucket])]
        steps = bucket_steps(spec, bucket, SampleMode.GREEDY, drafter=True)
        assert {st.phase: st.width for st in steps if st.phase is not Phase.VERIFY} == \
            {Phase.CONTEXT: CONTEXT_ROUNDS * commit, Phase.DECODE: 1, Phase.DRAFT: draft}
        assert max(st.width for st in steps if st.phase is Phase.VERIFY) == verify[bucket]
        check_widths(rc, steps, bucket, runner.cache_cfg.pages_per_row)   # what capture checks


def test_a_tree_of_another_width_is_refused(target, monkeypatch):
    """The builder path checks its output against spec.width, and so do graph capture (the tree
    buffers against the widest verify) and the runner's cache."""
    spec = SpecConfig("ddtree", 8, 32)
    runner = make_runner(target, spec)
    rc, kv_len = runner.round_ctx, runner.round_kv_len(9)
    rounds.draft_phase(rc, 2, kv_len)
    steps = bucket_steps(spec, 1, SampleMode.GREEDY, drafter=True)
    check_widths(rc, steps, 1, runner.cache_cfg.pages_per_row)
    narrow = SpecConfig("ddtree", 8, 8)   # tree buffers of another spec's width
    other = make_runner(target, narrow)
    monkeypatch.setattr(rc.state, "tree", other.state.tree)
    with pytest.raises(AssertionError, match="draft tree"):
        check_widths(rc, steps, 1, runner.cache_cfg.pages_per_row)
    with pytest.raises(AssertionError, match="tree buffers"):
        rc.state.store_tree(rounds.make_tree(rc, rounds.draft(rc, 2, kv_len), 2))
    monkeypatch.setattr(rounds, "tree_builder", lambda device, budget: lambda lg, root, n: build_tree(lg, root, n - 1))
    with pytest.raises(AssertionError, match="verify width 33"):
        rounds.draft_phase(rc, 2, kv_len)
    with pytest.raises(ValueError, match="headroom"):   # a cache sized for narrower rounds
        ModelRunner(target, None, spec, CacheConfig(ROWS, MAX_LEN, 32), torch.device("cpu"), torch.float32)


def test_the_draft_head_reads_its_weight_once(target):
    """The drafter's LM head over a block's positions 1..depth of every row is one product: a
    strided slice fed to it as is becomes a batched product over one copy of the head per row,
    which reads the weight once per row (the batched draft's main cost on a large vocabulary)."""
    from torch.profiler import profile
    drafter = drafter_for(target, torch.device("cpu"), torch.float32, 8, layers=1, layer_ids=(0, 1))
    hidden = torch.randn(3, 8, TARGET.hidden_size)
    with profile() as prof:
        logits = drafter.draft_logits(hidden, 5)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::bmm" not in ops and "aten::mm" in ops, ops
    want = torch.stack([target.lm_head(hidden[b, 1:6]) for b in range(3)])
    assert logits.shape == (3, 5, TARGET.vocab_size) and torch.allclose(logits, want, atol=1e-5)
