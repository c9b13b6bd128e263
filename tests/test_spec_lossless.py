"""Speculative decoding is lossless at temperature 0 (fp32, CPU).

DFlash (chain) and DDTree (tree) must emit exactly the tokens of plain greedy decoding of the
same target, whatever the block size, the tree budget, the batch composition, or where inside
an accepted block a request stops. Tiny vocabularies make the random drafters right often
enough that deep paths and side branches really get accepted; the tests check that they do,
so that they cannot pass on rounds that accept nothing.
"""
from __future__ import annotations

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.spec_decode import rounds
from tests.helpers import MAX_TOKENS, VOCAB, check_lossless, greedy, make_prompts, taus_of
from tests.tiny import copy_checkpoint, edit_config, edit_tensors

SHAPE_NAMES = ["llama", "qwen2", "qwen3", "llama3"]
SMALL_VOCAB = 5      # small enough for a tree to hold every prefix of a short block


class TreeLog:
    """Records, for every DDTree round, the drafter's per-depth argmax (the DFlash chain), the
    tree, and the accepted path, by wrapping the functions the round calls."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, torch.Tensor]] = []
        self._pending: dict[str, torch.Tensor] = {}

    def wrap(self, monkeypatch) -> None:
        build, accept = rounds.build_tree, rounds.accept

        def build_tree(draft_logits, root_tokens, budget):
            tree = build(draft_logits, root_tokens, budget)
            self._pending = {"chain": draft_logits.argmax(-1).clone()}
            return tree

        def accept_walk(tree, picks, max_depth=None):
            acc = accept(tree, picks, max_depth)
            if self._pending:
                self.rounds.append(dict(self._pending, tokens=tree.tokens.clone(), parents=tree.parents.clone(),
                                        path=acc.path.clone(), tau=acc.accept_len.clone()))
                self._pending = {}
            return acc

        monkeypatch.setattr(rounds, "build_tree", build_tree)
        monkeypatch.setattr(rounds, "accept", accept_walk)

    def side_branch_accepts(self) -> int:
        """Accepted nodes whose token is not the drafter's argmax at their depth: off the chain
        that DFlash would have verified."""
        n = 0
        for r in self.rounds:
            for b in range(r["tau"].shape[0]):
                for d in range(1, int(r["tau"][b])):
                    n += int(r["tokens"][b, r["path"][b, d]] != r["chain"][b, d - 1])
        return n

    def chain_rounds(self, start: int = 0) -> list[bool]:
        """Per round from `start` (batch of one): is the tree exactly the drafter's argmax chain?"""
        out = []
        for r in self.rounds[start:]:
            assert r["tokens"].shape[0] == 1, "chain_rounds expects one request per round"
            L = r["chain"].shape[1]
            n = r["tokens"].shape[1] - 1
            want_tokens = r["chain"][0, :n]
            want_parents = torch.arange(n)
            out.append(n <= L and bool((r["tokens"][0, 1:] == want_tokens).all())
                       and bool((r["parents"][0, 1:] == want_parents).all()))
        return out


@pytest.fixture
def tree_log(monkeypatch):
    log = TreeLog()
    log.wrap(monkeypatch)
    return log


def round_spans(out) -> list[tuple[int, int]]:
    """Output index ranges [a, b) of the tokens each step committed: the prefill's first token,
    then one span per round (the last one cut where the request stopped)."""
    spans, a = [(0, 1)], 1
    for tau in out.metrics["accept_lengths"]:
        b = min(a + tau, len(out.token_ids))
        spans.append((a, b))
        a = b
    return spans


def inside_block_positions(out) -> list[int]:
    """Output indices j committed by a round that accepted >= 2 tokens, j not the round's last:
    a request stopping at j stops inside an accepted block."""
    return [j for a, b in round_spans(out)[1:] if b - a >= 2 for j in range(a, b - 1)]


# -- DFlash ----------------------------------------------------------------------------------

DFLASH_GRID = [("llama", bs) for bs in (2, 4, 8, 16)] + [("qwen2", 2), ("qwen2", 8), ("qwen3", 4), ("qwen3", 16),
                                                          ("llama3", 8), ("llama3", 16)]


@pytest.mark.parametrize("shape,block_size", DFLASH_GRID)
def test_dflash_matches_plain(zoo, shape, block_size):
    """Block size overridden at construction (the drafter was written with 4); prompts of 1, 7
    and 30 tokens batched together."""
    pair = zoo(shape)
    llm = pair.llm("dflash", block_size)
    assert llm.engine.spec.block_size == block_size
    check_lossless(pair, llm, make_prompts(pair.vocab), max_tau=block_size)


def test_dflash_small_vocab_accepts_deep(zoo):
    """With 5 tokens the random drafter's chain is sometimes right for several positions: the
    lossless checks above then also cover long accepted chains."""
    taus = []
    for shape in SHAPE_NAMES:
        pair = zoo(shape, SMALL_VOCAB)
        for bs in (4, 8):
            taus += taus_of(check_lossless(pair, pair.llm("dflash", bs), make_prompts(pair.vocab), max_tau=bs))
    assert max(taus) >= 3, f"no DFlash round accepted 3 tokens: {sorted(set(taus))}"


# -- DDTree ----------------------------------------------------------------------------------

def _ddtree_grid():
    """Every budget with every block size on llama; on the other shapes the budgets 1 and
    block_size - 1 with every block size, and 32 or 100 in turn."""
    grid = []
    for shape in SHAPE_NAMES:
        for bs in (2, 4, 8, 16):
            budgets = [1, 2, bs - 1, 32, 100] if shape == "llama" else [1, bs - 1, 32 if bs in (4, 16) else 100]
            grid += [(shape, bs, b) for b in sorted(set(budgets))]
    return grid


@pytest.mark.parametrize("shape,block_size,budget", _ddtree_grid())
def test_ddtree_matches_plain(zoo, tree_log, shape, block_size, budget):
    pair = zoo(shape)
    llm = pair.llm("ddtree", block_size, budget)
    assert (llm.engine.spec.block_size, llm.engine.spec.budget) == (block_size, budget)
    rounds_before = llm.engine.stats.rounds
    # a tree of `budget` nodes is at most `budget` deep, and no deeper than the block
    outs = check_lossless(pair, llm, make_prompts(pair.vocab), max_tau=min(budget, block_size - 1) + 1)
    taus = taus_of(outs)
    assert len(tree_log.rounds) == llm.engine.stats.rounds - rounds_before > 0, "rounds built no trees"
    if budget >= 32 and block_size >= 4:
        # 32+ nodes over 7 tokens: paths go deeper than one drafted token, and off the chain
        assert max(taus) >= 3, f"no round accepted 3 tokens: {sorted(set(taus))}"
        assert tree_log.side_branch_accepts() > 0, "no accepted node off the drafter's argmax chain"


@pytest.mark.parametrize("shape", SHAPE_NAMES)
def test_ddtree_whole_prefix_space(zoo, tree_log, shape):
    """A budget above the number of all prefixes (5 + 25 + 125 = 155 for block 4) puts every
    continuation in the tree: every round accepts a full block, whatever the drafter says."""
    pair = zoo(shape, SMALL_VOCAB)
    for bs, budget in [(2, 8), (3, 40), (4, 300)] if shape == "llama" else [(4, 300)]:
        assert budget > sum(SMALL_VOCAB ** d for d in range(1, bs))
        outs = check_lossless(pair, pair.llm("ddtree", bs, budget), make_prompts(pair.vocab), max_tau=bs)
        for out in outs:
            taus = out.metrics["accept_lengths"]
            assert all(t == bs for t in taus[:-1]), (bs, budget, taus)
    assert tree_log.side_branch_accepts() > 0


# -- batches, max_tokens and stops inside a block ----------------------------------------------

SPEC_CONFIGS = [("dflash", 4, None), ("ddtree", 4, 32), ("ddtree", 8, 100)]


@pytest.mark.parametrize("spec,block_size,budget", SPEC_CONFIGS)
@pytest.mark.parametrize("shape", ["llama", "qwen2"])
def test_more_requests_than_rows(zoo, shape, spec, block_size, budget):
    """Six requests of different lengths and max_tokens through three cache rows: requests
    finish at different rounds, the others move into their rows, new ones are admitted."""
    pair = zoo(shape)
    prompts = make_prompts(pair.vocab, lens=(30, 1, 12, 7, 2, 19), seed=5)
    max_tokens = [5, 40, 17, 29, 1, 11]
    max_tau = block_size if spec == "dflash" else min(budget, block_size - 1) + 1
    llm = pair.llm(spec, block_size, budget)
    batched = check_lossless(pair, llm, prompts, max_tokens, max_tau=max_tau)
    check_lossless(pair, pair.llm("none"), prompts, max_tokens, max_tau=1)
    # A draft depends only on the request's own context, so each request's rounds accept the
    # same lengths alone as in the shuffled batch: the drafter's cache rows and context
    # features moved with their requests.
    for p, n, out in zip(prompts, max_tokens, batched):
        (alone,) = llm.generate([p], greedy(n))
        assert out.metrics["accept_lengths"] == alone.metrics["accept_lengths"], len(p)
    assert max(t for o in batched for t in o.metrics["accept_lengths"]) >= 2


@pytest.mark.parametrize("spec,block_size,budget", SPEC_CONFIGS + [("ddtree", 4, 300)])
def test_max_tokens_inside_a_block(zoo, spec, block_size, budget):
    vocab = SMALL_VOCAB if budget == 300 else VOCAB
    pair = zoo("llama", vocab)
    llm = pair.llm(spec, block_size, budget)
    max_tau = block_size if spec == "dflash" else min(budget, block_size - 1) + 1
    cut = 0
    for n in (13, 14):
        cut += sum(1 + sum(o.metrics["accept_lengths"]) > n for o in
                   check_lossless(pair, llm, make_prompts(vocab), n, max_tau=max_tau))
    # positions inside accepted blocks of an unbounded run give max_tokens that must cut a block
    for p in make_prompts(vocab, lens=(3, 9, 16), seed=1):
        (full,) = llm.generate([p], greedy())
        for j in inside_block_positions(full)[:2]:
            (out,) = check_lossless(pair, llm, [p], j + 1, max_tau=max_tau)
            assert 1 + sum(out.metrics["accept_lengths"]) > j + 1
            cut += 1
    assert cut > 0, "no run ended inside an accepted block"


def _first_occurrence_inside_block(out) -> int | None:
    toks = out.token_ids
    for j in inside_block_positions(out):
        if toks[j] not in toks[:j]:
            return j
    return None


@pytest.mark.parametrize("spec,block_size,budget", SPEC_CONFIGS)
def test_stop_token_inside_accepted_block(zoo, tmp_path, spec, block_size, budget):
    """A stop id (and, on a copy of the target, an EOS id) that first appears inside a round's
    accepted block: the output is plain's up to and including it, the rest of the block is
    dropped, finish_reason is "stop"."""
    found = 0
    for vocab in (VOCAB, SMALL_VOCAB):
        pair = zoo("llama", vocab)
        llm = pair.llm(spec, block_size, budget)
        for p in make_prompts(vocab, lens=(1, 4, 7, 11, 30), seed=2):
            (full,) = llm.generate([p], greedy())
            assert full.token_ids == pair.plain(p)
            j = _first_occurrence_inside_block(full)
            if j is None:
                continue
            stop = full.token_ids[j]
            want = pair.plain(p)[:j + 1]
            (plain,) = pair.llm("none").generate([p], greedy(stop_token_ids=[stop]))
            (got,) = llm.generate([p], greedy(stop_token_ids=[stop]))
            assert plain.token_ids == want and plain.finish_reason == "stop"
            assert got.token_ids == want, (stop, j)
            assert got.finish_reason == "stop"
            # the round that met the stop accepted tokens past it
            assert 1 + sum(got.metrics["accept_lengths"]) > j + 1
            if not found:
                # the same through EOS from the checkpoint's config (not ignored this time)
                eos_target = edit_config(copy_checkpoint(pair.target, tmp_path / f"eos-{vocab}"), eos_token_id=stop)
                eos_llm = LLM(model=str(eos_target), draft_model=str(pair.drafter), spec=spec,
                              block_size=block_size, budget=budget, device="cpu", dtype="float32",
                              max_num_seqs=2, max_model_len=128)
                a, b = eos_llm.generate([p, p], [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                                 greedy()])
                assert a.token_ids == want and a.finish_reason == "stop"
                assert b.token_ids == pair.plain(p) and b.finish_reason == "length"   # ignore_eos
            found += 1
    assert found >= 2, "no stop token fell inside an accepted block"


# -- DDTree restricted to a chain is DFlash ---------------------------------------------------

@pytest.fixture(scope="module")
def sharp_drafter(zoo, tmp_path_factory):
    """The small-vocabulary llama pair's drafter with its final norm scaled 100x: its
    per-position distributions become so peaked that the top (block_size - 1) prefixes are
    usually the argmax chain, i.e. the DDTree of budget block_size - 1 is DFlash's chain."""
    pair = zoo("llama", SMALL_VOCAB)
    path = copy_checkpoint(pair.drafter, tmp_path_factory.mktemp("sharp") / "drafter")
    return edit_tensors(path, lambda w: {**w, "norm.weight": w["norm.weight"] * 100.0})


@pytest.mark.parametrize("block_size", [4, 8])
def test_ddtree_chain_budget_equals_dflash(zoo, sharp_drafter, tree_log, block_size):
    """Both methods commit the plain tokens, so a round of each that starts at the same length
    sees the same context. Where DDTree's tree of block_size - 1 nodes is the argmax chain (as
    recorded), it must accept exactly what DFlash accepted from that length."""
    pair = zoo("llama", SMALL_VOCAB)
    dflash = pair.llm("dflash", block_size, drafter=sharp_drafter)
    ddtree = pair.llm("ddtree", block_size, block_size - 1, drafter=sharp_drafter)
    compared, chains, total, deep = 0, 0, 0, 0
    for p in make_prompts(pair.vocab, lens=(1, 7, 30, 12), seed=3):
        (a,) = dflash.generate([p], greedy())
        start = len(tree_log.rounds)
        (b,) = ddtree.generate([p], greedy())
        assert a.token_ids == b.token_ids == pair.plain(p)
        is_chain = tree_log.chain_rounds(start)
        assert len(is_chain) == len(b.metrics["accept_lengths"])
        dflash_tau = {s: t for (s, _), t in zip(round_spans(a)[1:], a.metrics["accept_lengths"])}
        for (s, _), tau, chain in zip(round_spans(b)[1:], b.metrics["accept_lengths"], is_chain):
            total += 1
            chains += chain
            if chain and s in dflash_tau:
                assert tau == dflash_tau[s], f"prompt of {len(p)}: round at output {s}"
                compared += 1
                deep += tau >= 2
    assert chains >= 0.8 * total, f"the sharp drafter's tree was the chain in only {chains}/{total} rounds"
    assert compared >= 0.5 * total
    assert deep > 0, "the chain never accepted a drafted token: the comparison is vacuous"


def test_flat_drafter_tree_is_not_the_chain(zoo, tree_log):
    """Control for the test above: with the unsharpened drafter, a tree of block_size - 1
    nodes is often not the argmax chain (it prefers second choices near the root), so the
    chain check can fail."""
    pair = zoo("llama", SMALL_VOCAB)
    (out,) = pair.llm("ddtree", 4, 3, max_num_seqs=1).generate([make_prompts(pair.vocab)[1]], greedy())
    assert out.token_ids == pair.plain(make_prompts(pair.vocab)[1])
    assert not all(tree_log.chain_rounds())


# -- context limits ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec,block_size,budget", [("none", None, None), ("dflash", 16, None),
                                                    ("ddtree", 8, 100)])
def test_context_limit(zoo, spec, block_size, budget):
    pair = zoo("qwen3")
    llm = pair.llm(spec, block_size, budget, max_model_len=32)
    assert llm.engine.max_model_len == 32
    g = torch.Generator().manual_seed(7)
    too_long = torch.randint(0, pair.vocab, (32,), generator=g).tolist()
    with pytest.raises(ValueError, match=r"32 tokens.*1 to 31"):
        llm.generate([too_long], greedy())
    with pytest.raises(ValueError, match="32 tokens"):
        llm.generate([[1, 2], too_long], greedy())          # one bad prompt refuses the batch
    with pytest.raises(ValueError, match="0 tokens"):
        llm.generate([[]], greedy())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, pair.vocab]], greedy())
    assert not llm.engine.has_unfinished()                  # nothing was queued

    with pytest.raises(ValueError, match="the prompt has 17 and max_tokens asks for 100 more: lower max_tokens to at "
                                         "most 15"):
        llm.generate([too_long[:17]], greedy(100))         # past the context: refused before any work
    assert not llm.engine.has_unfinished()

    long_plain = pair.llm("none", max_model_len=128)
    for n in (31, 30, 28, 24, 17):
        p = too_long[:n]
        (out,) = llm.generate([p], greedy(None))            # up to the context's end
        (ref,) = long_plain.generate([p], greedy(32 - n))
        assert out.token_ids == ref.token_ids, n
        assert len(out.token_ids) == 32 - n
        assert out.finish_reason == "length"


@pytest.mark.parametrize("spec,block_size,budget", [("none", None, None), ("ddtree", 4, 32)])
def test_admit_min_batches_admissions(zoo, spec, block_size, budget):
    """With admit_min, waiting requests are admitted in groups once enough rows are free:
    fewer prefill calls, the same tokens."""
    pair = zoo("llama")
    prompts = make_prompts(pair.vocab, lens=(9, 3, 14, 6, 2, 11, 5, 8, 4, 12), seed=9)
    max_tokens = [3, 17, 5, 9, 2, 13, 7, 4, 11, 6]
    calls = []
    for admit_min in (1, 3):
        llm = LLM(model=str(pair.target), draft_model=None if spec == "none" else str(pair.drafter), spec=spec,
                  block_size=block_size, budget=budget, device="cpu", dtype="float32", max_num_seqs=4,
                  max_model_len=128, admit_min=admit_min)
        n = [0]

        def counted(*a, real=llm.engine.runner.prefill, n=n, **k):
            n[0] += 1
            return real(*a, **k)
        llm.engine.runner.prefill = counted
        outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
        for p, m, out in zip(prompts, max_tokens, outs):
            assert out.token_ids == pair.plain(p, m)
        calls.append(n[0])
    assert calls[1] < calls[0], calls


@pytest.mark.parametrize("spec,budget", [("none", None), ("dflash", 1), ("ddtree", 8)])
def test_few_row_attention_path_on_the_cache(zoo, monkeypatch, spec, budget):
    """The attention that CUDA takes for decode, draft and verify (two matmuls over views of the
    cache), forced on CPU: same tokens as plain greedy through SDPA, batched."""
    from drafttree.kernels import dispatch
    pair = zoo("qwen3")
    prompts = make_prompts(pair.vocab)
    want = [pair.plain(p) for p in prompts]
    calls = []
    monkeypatch.setattr(dispatch, "few_rows", lambda q, rows: calls.append(rows) or rows <= 128)
    llm = LLM(model=str(pair.target), draft_model=None if spec == "none" else str(pair.drafter), spec=spec,
              budget=budget, device="cpu", dtype="float32", max_num_seqs=3, max_model_len=128)
    assert [o.token_ids for o in llm.generate(prompts, greedy())] == want
    assert sum(n <= 128 for n in calls) > MAX_TOKENS   # the path really ran, every round


@pytest.mark.parametrize("spec,budget", [("dflash", None), ("ddtree", 8)])
def test_parked_rows_write_inside_the_cache(zoo, monkeypatch, spec, budget):
    """A graph runs its whole batch bucket, rows without a request parked. Their round must write
    only cache slots that exist: the KV-write kernel has no bounds check, and a slot of -1 wrote
    before the cache (an illegal address on the GPU at batch 16)."""
    from drafttree.kernels import dispatch
    from drafttree.sampling import SampleMode
    llm = zoo("qwen3").llm(spec, budget=budget)
    r = llm.engine.runner
    seen = []
    real = dispatch.write_kv
    monkeypatch.setattr(dispatch, "write_kv", lambda kc, vc, rows, slots, k, v:
                        seen.append((int(slots.min()), int(slots.max()), kc.shape[-2])) or real(kc, vc, rows, slots, k, v))
    R = r.state.start.shape[0]
    r.state.park(0, R)
    rounds.spec_round(r.round_ctx, R, 64, SampleMode.GREEDY)
    assert seen and all(0 <= lo and hi < L for lo, hi, L in seen), seen
    assert bool((r.state.start >= r.state.ctx_n).all())
