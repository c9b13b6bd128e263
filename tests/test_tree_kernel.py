"""The fused tree kernel against `build_tree`, field by field.

Without CUDA the kernel runs under the Triton interpreter on CPU (conftest.py turns it on).
"""

from __future__ import annotations

import random

import pytest
import torch

from drafttree.kernels import dispatch
from drafttree.kernels.tree_kernel import available
from drafttree.spec_decode.tree import DraftTree, build_tree
from tests.helpers import DEVICE, ON_CPU, TRITON_REASON, interpreted_on_cpu
from tests.tree_reference import KINDS, brute_force_scores, check_tree, log_probs, make_logits

pytest.importorskip("triton", reason=TRITON_REASON)

FIELDS = ("tokens", "parents", "depth", "valid", "visible")


def build_tree_fused(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budget: int) -> DraftTree:
    """The fused build (`dispatch.build_tree_fused`) as the rounds take it, a DraftTree."""
    return DraftTree(*dispatch.build_tree_fused(draft_logits, root_tokens, budget))


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)
    assert available(DEVICE)


def stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """topk that orders equal values by index, as the kernel does."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def assert_same(a: DraftTree, b: DraftTree) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.cpu(), y.cpu()), name


def node_scores(tree: DraftTree, logits: torch.Tensor) -> list[list[float]]:
    """Float64 score of every valid node, in column order."""
    out = []
    for r in range(tree.tokens.shape[0]):
        lp = log_probs(logits[r].float().cpu())
        score = [0.0]
        for j in range(1, tree.num_nodes):
            if tree.valid[r, j]:
                d = int(tree.depth[r, j])
                score.append(score[int(tree.parents[r, j])] + lp[d - 1][int(tree.tokens[r, j])])
        out.append(score)
    return out


# On CUDA nearly every random case is a new Triton compile (its L, K and budget are constexprs,
# a few seconds each): fewer cases there; the interpreter runs them all in CI.
RANDOM_CASES, TIE_CASES = (40, 8) if ON_CPU else (12, 4)


def random_case(rng: random.Random, gen: torch.Generator,
                kind: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    R, L, V = rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 50)
    space = sum(V ** d for d in range(1, L + 1))
    budget = min(64, rng.choice([1, 2, rng.randint(3, 64), space, space + rng.randint(1, 5)]))
    if rng.random() < 0.15:  # more nodes than prefixes of nonzero probability
        L, V = rng.randint(1, 3), rng.randint(1, 3)
        budget = sum(V ** d for d in range(1, L + 1)) + rng.randint(1, 8)
    logits = make_logits(gen, kind, R, L, V)
    return logits.to(DEVICE), torch.randint(0, 100, (R,), generator=gen).to(DEVICE), budget


def test_matches_build_tree_without_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(RANDOM_CASES):
        logits, roots, budget = random_case(rng, gen, "normal")
        assert_same(build_tree_fused(logits, roots, budget), build_tree(logits, roots, budget))


@pytest.mark.parametrize("kind", KINDS)
def test_matches_stable_build_tree_with_ties(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ties, build_tree's order depends on the backend's topk; with a stable topk
    the kernel matches it exactly, and with the real one it builds a tree of the same
    node scores in the same order, passing every invariant of test_tree."""
    gen = torch.Generator().manual_seed(10 + KINDS.index(kind))
    rng = random.Random(10 + KINDS.index(kind))
    for _ in range(TIE_CASES):
        logits, roots, budget = random_case(rng, gen, kind)
        fused = build_tree_fused(logits, roots, budget)
        ref = build_tree(logits, roots, budget)
        assert torch.equal(fused.valid, ref.valid)
        for a, b in zip(node_scores(fused, logits), node_scores(ref, logits)):
            assert a == pytest.approx(b, abs=1e-4)
        for r in range(logits.shape[0]):
            lp = log_probs(logits[r].float().cpu())
            exact = brute_force_scores(lp, budget) if logits.shape[2] ** logits.shape[1] <= 4096 else None
            check_tree(_cpu(fused), r, lp, budget, int(roots[r]), exact)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "topk", stable_topk)
            assert_same(build_tree_fused(logits, roots, budget), build_tree(logits, roots, budget))


def _cpu(tree: DraftTree) -> DraftTree:
    return DraftTree(*(getattr(tree, name).cpu() for name in FIELDS))


@pytest.mark.parametrize("budget", [32, 128])
def test_matches_build_tree_larger(budget: int) -> None:
    gen = torch.Generator().manual_seed(budget)
    logits = (torch.randn(2, 15, 1000, generator=gen) * 3).to(DEVICE)
    roots = torch.tensor([3, 4], device=DEVICE)
    assert_same(build_tree_fused(logits, roots, budget), build_tree(logits, roots, budget))


def test_edge_cases() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 9, generator=gen).to(DEVICE)
    roots = torch.tensor([5, 6, 7], device=DEVICE)
    for logits, budget in [(x, 1), (x[:, :1], 4), (x[:, :1], 9), (x[:, :1], 12),
                           (x[:1, :3, :2], 20), (x[:, :, :1], 6), (x.bfloat16(), 10)]:
        fused = build_tree_fused(logits, roots[: logits.shape[0]], budget)
        assert_same(fused, build_tree(logits, roots[: logits.shape[0]], budget))
    with pytest.raises(ValueError):
        build_tree_fused(x, roots, 0)


def test_availability_and_fallback() -> None:
    """The rounds build with the kernel where it runs and the budget is one it wins at, else with
    `build_tree`."""
    from drafttree.spec_decode.rounds import tree_builder
    assert available(DEVICE, 128) and not available(DEVICE, 129)
    device = torch.device(DEVICE)
    assert tree_builder(device, 128) is not build_tree and tree_builder(device, 129) is build_tree
    # meta tensors hold no data: only build_tree's static-shape path can take them
    assert not available("meta") and not dispatch.fused_tree_usable("meta", 64)
    build = tree_builder(torch.device("meta"), 64)
    assert build is build_tree
    tree = build(torch.empty(2, 15, 1000, device="meta"), torch.empty(2, dtype=torch.long, device="meta"), 64)
    assert tree.visible.shape == (2, 65, 65)


def graphed_us(fn, iters: int = 200) -> tuple[float, DraftTree]:
    from drafttree.bench.graph_timer import graphed
    return graphed(fn, n=1, replays=iters)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 8])
def test_cuda_full_vocab_graphed(R: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(R)
    logits = torch.randn(R, 15, 151936, device="cuda", generator=gen) * 4
    roots = torch.arange(R, device="cuda")
    for budget in (32, 128, 512):
        ref_us, ref = graphed_us(lambda b=budget: build_tree(logits, roots, b))
        fused_us, fused = graphed_us(lambda b=budget: build_tree_fused(logits, roots, b))
        assert_same(fused, ref)
        assert_same(build_tree_fused(logits, roots, budget), ref)
        print(f"\nR={R} budget={budget}: build_tree {ref_us:.1f} us, build_tree_fused {fused_us:.1f} us"
              " (CUDA graph replay)")


@pytest.mark.parametrize("V,k,chunk", [(1000, 8, 256), (777, 5, 128), (300, 32, 64), (50, 50, 64), (400, 1, 128),
                                     (2500, 16, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filtered", [True, False])
def test_topk_kernel_matches_a_stable_sort(V, k, chunk, dtype, filtered, monkeypatch):
    """The two-launch top-K and normalizer: the k best ids, equal values to the smaller id first
    (coarse integer logits make many ties), log-probs against torch's log_softmax; -inf
    entries and a whole -inf chunk included."""
    from drafttree.kernels import topk_kernel
    from drafttree.kernels.topk_kernel import top_log_probs_fused
    monkeypatch.setattr(topk_kernel, "FILTERED", filtered)
    g = torch.Generator().manual_seed(V + k)
    x = torch.randint(-6, 6, (2, 3, V), generator=g).float().to(dtype)
    x[0, 0, :chunk] = float("-inf")
    x[1, 2, 7] = float("-inf")
    x = x.to(DEVICE)
    lp, idx = top_log_probs_fused(x, k, interpret=ON_CPU, chunk=chunk)
    xf = x.float()
    want_val, want_idx = torch.sort(xf, dim=-1, descending=True, stable=True)
    assert torch.equal(idx, want_idx[..., :k])
    want_lp = want_val[..., :k] - torch.logsumexp(xf, dim=-1, keepdim=True)
    finite = torch.isfinite(want_lp)
    assert torch.equal(finite, torch.isfinite(lp))
    torch.testing.assert_close(lp[finite], want_lp[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k,chunk", [(8, 1024), (32, 512), (100, 2048)])
def test_topk_kernel_filtered_path_on_distinct_logits(k, chunk):
    """Distinct logits, where (checked here) every chunk has at most CAP entries at or above its
    threshold, so the group-maxima filter, not the fallback sort, picks each chunk's top K."""
    from drafttree.kernels import topk_kernel
    from drafttree.kernels.topk_kernel import top_log_probs_fused
    assert topk_kernel.FILTERED   # the default
    V = 3 * chunk + 77
    x = torch.randn(2, 2, V, generator=torch.Generator().manual_seed(k))
    k2 = max(2, 1 << (k - 1).bit_length())
    cap = topk_kernel.filter_plan(k2, chunk)[1]
    assert (topk_kernel.filter_counts(x, k2, chunk) <= cap).all()
    lp, idx = top_log_probs_fused(x.to(DEVICE), k, interpret=ON_CPU, chunk=chunk)
    want_val, want_idx = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(idx.cpu(), want_idx[..., :k])
    torch.testing.assert_close(lp.cpu(), want_val[..., :k] - torch.logsumexp(x, -1, keepdim=True))


@pytest.mark.parametrize("k,chunk", [(8, 512), (32, 4096)])
def test_topk_kernel_filter_threshold_with_tied_group_maxima(k, chunk):
    """More groups than K2 share the largest maximum: the threshold is that value, every tied
    entry is a candidate (within CAP) and the top K comes back smaller id first."""
    from drafttree.kernels.topk_kernel import filter_plan, top_log_probs_fused
    k2 = max(2, 1 << (k - 1).bit_length())
    groups, cap, _ = filter_plan(k2, chunk)
    V = 2 * chunk
    x = torch.randn(1, 1, V, generator=torch.Generator().manual_seed(k)).clamp(max=4.0)
    tied = torch.arange(k2 + 4) * 3 + 1   # in chunk 0, one entry in each of k2 + 4 groups
    assert len(set((tied % groups).tolist())) == k2 + 4 and k2 + 4 <= cap and tied[-1] < chunk
    x[0, 0, tied] = 5.0
    lp, idx = top_log_probs_fused(x.to(DEVICE), k, interpret=ON_CPU, chunk=chunk)
    assert torch.equal(idx.cpu()[0, 0], tied[:k])
    torch.testing.assert_close(lp.cpu(), 5.0 - torch.logsumexp(x, -1, keepdim=True).expand(1, 1, k))


@pytest.mark.parametrize("extra", [0, 1], ids=["CAP candidates", "CAP + 1: whole-chunk sort"])
def test_topk_kernel_filter_at_its_capacity(extra):
    """A chunk with exactly CAP candidates (ties at the threshold, from more than K2 groups) takes
    the filtered path with every slot full; one more sends it to the whole-chunk sort. Both give
    the K smallest ids of the tied top value."""
    from drafttree.kernels.topk_kernel import filter_counts, filter_plan, top_log_probs_fused
    k, chunk = 8, 512
    groups, cap, _ = filter_plan(k, chunk)
    x = -torch.rand(1, 1, 2 * chunk, generator=torch.Generator().manual_seed(extra))
    tied = torch.randperm(chunk, generator=torch.Generator().manual_seed(1))[:cap + extra]
    x[0, 0, tied] = 5.0
    assert len(set((tied % groups).tolist())) > k
    assert filter_counts(x, k, chunk)[0, 0, 0] == cap + extra
    lp, idx = top_log_probs_fused(x.to(DEVICE), k, interpret=ON_CPU, chunk=chunk)
    assert torch.equal(idx.cpu()[0, 0], tied.sort().values[:k])
    torch.testing.assert_close(lp.cpu(), 5.0 - torch.logsumexp(x, -1, keepdim=True).expand(1, 1, k))


def test_topk_kernel_feeds_the_tree_builders():
    """Both tree builders take their scores from the kernel where it runs, so they still agree."""
    from drafttree.spec_decode import tree
    logits = make_logits(torch.Generator().manual_seed(5), "int", 1, 3, 200).to(DEVICE)
    lp, idx = tree.top_log_probs(logits, 16)
    want_val = torch.sort(logits.float(), dim=-1, descending=True).values[..., :16]
    assert torch.equal(logits.float().gather(-1, idx), want_val)        # ids of the top values
    root = torch.zeros(1, dtype=torch.long, device=DEVICE)
    a, b = build_tree(logits, root, 16), build_tree_fused(logits, root, 16)
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
