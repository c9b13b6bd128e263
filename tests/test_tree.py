"""Draft tree construction and acceptance against pure-Python references."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest
import torch

from drafttree.spec_decode.tree import DraftTree, accept, ancestor_mask, build_tree, chain_tree
from tests.tree_reference import (KINDS, NEG_INF, brute_force_scores, check_tree, close, log_probs, make_logits,
                                  path_picks, random_tree)


def heap_reference(lp: list[list[float]], budget: int) -> list[tuple[tuple[int, ...], float]]:
    """Best-first search: (prefix, score) in pop order."""
    L, V = len(lp), len(lp[0])
    order = [sorted(range(V), key=lambda y: (-lp[d][y], y)) for d in range(L)]
    counter = itertools.count()
    # entry: (-score, depth, tie, parent prefix, rank at this depth)
    heap = [(-lp[0][order[0][0]], 1, next(counter), (), 0)]
    out = []
    while heap and len(out) < budget:
        neg, d, _, parent, rank = heapq.heappop(heap)
        if -neg == NEG_INF:
            break
        prefix = parent + (order[d - 1][rank],)
        out.append((prefix, -neg))
        base = -neg - lp[d - 1][prefix[-1]]
        if rank + 1 < V:
            sib = order[d - 1][rank + 1]
            heapq.heappush(heap, (-(base + lp[d - 1][sib]), d, next(counter), parent, rank + 1))
        if d < L:
            child = order[d][0]
            heapq.heappush(heap, (-(-neg + lp[d][child]), d + 1, next(counter), prefix, 0))
    return out


def python_walk(tree: DraftTree, r: int, pick: list[int], max_depth: int) -> list[int]:
    """Accepted node columns, root first."""
    tokens, parents = tree.tokens[r].tolist(), tree.parents[r].tolist()
    valid, depth = tree.valid[r].tolist(), tree.depth[r].tolist()
    path = [0]
    while nxt := [j for j in range(1, len(tokens)) if valid[j] and parents[j] == path[-1]
                  and tokens[j] == pick[path[-1]] and depth[j] <= max_depth]:
        path.append(nxt[0])
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_build_matches_bruteforce_and_heap(kind: str) -> None:
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    rng = random.Random(KINDS.index(kind))
    for _ in range(50):
        R, L, V = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 5)
        space = sum(V ** d for d in range(1, L + 1))
        budget = rng.choice([1, 2, rng.randint(3, 40), space, space + rng.randint(1, 6)])
        budget = min(budget, 160)
        logits = make_logits(gen, kind, R, L, V)
        roots = torch.randint(0, 100, (R,), generator=gen)
        tree = build_tree(logits, roots, budget)
        for r in range(R):
            lp = log_probs(logits[r])
            exact = brute_force_scores(lp, budget)
            scores = check_tree(tree, r, lp, budget, int(roots[r]), exact)
            ref = [s for _, s in heap_reference(lp, budget)]
            assert ref == pytest.approx(exact, abs=1e-9)
            assert close(scores[1: len(ref) + 1], ref)


@pytest.mark.parametrize("L,V,budget", [(5, 40, 64), (6, 7, 100), (3, 300, 17), (8, 3, 250)])
def test_build_matches_heap_larger(L: int, V: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(L * 1000 + V)
    for scale in (0.5, 2.0, 6.0):
        logits = torch.randn(2, L, V, generator=gen) * scale
        tree = build_tree(logits, torch.tensor([1, 2]), budget)
        for r in range(2):
            lp = log_probs(logits[r])
            ref = [s for _, s in heap_reference(lp, budget)]
            scores = check_tree(tree, r, lp, budget, r + 1, None)
            assert close(scores[1:], ref)


def test_budget_one() -> None:
    logits = torch.randn(3, 4, 9, generator=torch.Generator().manual_seed(1))
    tree = build_tree(logits, torch.tensor([5, 6, 7]), 1)
    assert tree.tokens.tolist() == [[5 + r, int(logits[r, 0].argmax())] for r in range(3)]
    assert tree.parents.tolist() == [[0, 0]] * 3 and tree.depth.tolist() == [[0, 1]] * 3
    assert tree.valid.all()
    assert tree.visible.tolist() == [[[True, False], [True, True]]] * 3


def test_budget_exceeds_prefix_space() -> None:
    logits = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(2))
    tree = build_tree(logits, torch.tensor([9]), 20)
    lp = log_probs(logits[0])
    check_tree(tree, 0, lp, 20, 9, brute_force_scores(lp, 20))
    assert int(tree.valid.sum()) == 1 + 14
    assert not tree.visible[0, 15:, 1:15].any()
    assert tree.visible[0, 15:, 0].all()


def test_single_position() -> None:
    logits = torch.randn(2, 1, 10, generator=torch.Generator().manual_seed(3))
    tree = build_tree(logits, torch.tensor([0, 0]), 4)
    expect = logits[:, 0].topk(4).indices
    assert torch.equal(tree.tokens[:, 1:], expect)
    assert (tree.depth[:, 1:] == 1).all() and (tree.parents == 0).all()


def test_batch_rows_independent() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.cat([torch.randn(1, 4, 6, generator=gen) * s for s in (0.2, 1.0, 5.0, 30.0)])
    roots = torch.tensor([1, 2, 3, 4])
    tree = build_tree(logits, roots, 12)
    for r in range(4):
        single = build_tree(logits[r: r + 1], roots[r: r + 1], 12)
        for name in ("tokens", "parents", "depth", "valid", "visible"):
            assert torch.equal(getattr(tree, name)[r], getattr(single, name)[0])


def test_exact_parent_child_ties_stay_topological() -> None:
    logits = torch.full((1, 4, 3), NEG_INF)
    logits[0, :, 1] = 0.0  # every depth is certain: four nodes of score exactly 0
    logits[0, 0, 2] = -1.0
    tree = build_tree(logits, torch.tensor([0]), 6)
    assert tree.tokens[0, 1:5].tolist() == [1, 1, 1, 1]
    assert tree.parents[0, 1:5].tolist() == [0, 1, 2, 3]
    assert tree.valid[0].tolist() == [True] * 7
    lp = log_probs(logits[0])
    check_tree(tree, 0, lp, 6, 0, brute_force_scores(lp, 6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_input(dtype: torch.dtype) -> None:
    logits = (torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    tree = build_tree(logits, torch.tensor([0, 1]), 10)
    for r in range(2):
        lp = log_probs(logits[r].float())
        check_tree(tree, r, lp, 10, r, brute_force_scores(lp, 10))


def test_no_data_dependent_ops() -> None:
    # Meta tensors carry no data: any .item(), nonzero or host sync would raise.
    logits = torch.empty(2, 15, 1000, device="meta")
    tree = build_tree(logits, torch.empty(2, dtype=torch.long, device="meta"), 64)
    assert tree.visible.shape == (2, 65, 65)
    acc = accept(tree, torch.empty(2, 65, dtype=torch.long, device="meta"), 15)
    assert acc.path.shape == (2, 16) and acc.tokens.shape == (2, 16)


def check_accept(tree: DraftTree, pick: torch.Tensor, max_depth: int) -> None:
    acc = accept(tree, pick, max_depth)
    assert acc.path.shape == acc.tokens.shape == (tree.tokens.shape[0], max_depth + 1)
    for r in range(tree.tokens.shape[0]):
        path = python_walk(tree, r, pick[r].tolist(), max_depth)
        tau = len(path)
        assert int(acc.accept_len[r]) == tau
        padded = path + [path[-1]] * (max_depth + 1 - tau)
        assert acc.path[r].tolist() == padded
        assert acc.tokens[r].tolist() == [int(pick[r, j]) for j in padded]


def test_accept_on_built_trees() -> None:
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    for _ in range(150):
        R, L, V = rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 6)
        budget = rng.randint(1, 30)
        logits = make_logits(gen, rng.choice(KINDS), R, L, V)
        tree = build_tree(logits, torch.randint(0, V, (R,), generator=gen), budget)
        N = budget + 1
        mode = rng.choice(["random", "deep", "side", "none", "zeros"])
        # "none": no node holds V + 1; "zeros": invalid nodes hold 0 and must never be accepted
        pick = {"none": torch.full((R, N), V + 1), "zeros": torch.zeros(R, N, dtype=torch.long)}.get(
            mode, torch.randint(0, V, (R, N), generator=gen))
        for r in range(R if mode in ("deep", "side") else 0):
            cols = [j for j in range(1, N) if tree.valid[r, j]]
            deepest = max(int(tree.depth[r, j]) for j in cols)
            cols = [j for j in cols if tree.depth[r, j] == deepest] if mode == "deep" else cols[len(cols) // 2:]
            path_picks(tree, r, rng.choice(cols), pick)
        check_accept(tree, pick, L)


def test_accept_on_arbitrary_trees() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n, vocab = rng.randint(1, 20), rng.randint(1, 4)
        tree, max_depth = random_tree(rng, n, vocab)
        pick = torch.tensor([[rng.randrange(vocab) for _ in range(n)]])
        if n > 1 and rng.random() < 0.5:
            path_picks(tree, 0, rng.randrange(1, n), pick)
        check_accept(tree, pick, max_depth + rng.randint(0, 2))


def test_chain_tree_structure() -> None:
    tree = chain_tree(torch.tensor([[4, 5, 6]]), torch.tensor([3]))
    assert tree.tokens.tolist() == [[3, 4, 5, 6]]
    assert tree.parents.tolist() == [[0, 0, 1, 2]] and tree.depth.tolist() == [[0, 1, 2, 3]]
    assert tree.valid.all()
    assert torch.equal(tree.visible[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(tree.visible, ancestor_mask(tree.parents, 3))


def test_chain_accept_is_longest_prefix_plus_bonus() -> None:
    gen = torch.Generator().manual_seed(8)
    rng = random.Random(8)
    for _ in range(100):
        R, L, V = rng.randint(1, 4), rng.randint(1, 8), rng.randint(2, 5)
        draft = torch.randint(0, V, (R, L), generator=gen)
        pick = torch.randint(0, V, (R, L + 1), generator=gen)
        for r in range(R):  # target agrees with the draft on a random prefix
            n = rng.randint(0, L)
            pick[r, :n] = draft[r, :n]
        tree = chain_tree(draft, torch.randint(0, V, (R,), generator=gen))
        acc = accept(tree, pick)
        for r in range(R):
            n = 0
            while n < L and draft[r, n] == pick[r, n]:
                n += 1
            assert int(acc.accept_len[r]) == n + 1
            assert acc.tokens[r, : n + 1].tolist() == draft[r, :n].tolist() + [int(pick[r, n])]
            assert (acc.tokens[r, n:] == pick[r, n]).all()
            assert acc.path[r].tolist() == list(range(n + 1)) + [n] * (L - n)


@pytest.mark.parametrize("V,k", [(20_000, 1), (20_000, 32), (40_961, 128), (151_936, 32)])
def test_chunked_topk_equals_topk(V, k):
    from drafttree.kernels.torch_ops import chunked_topk

    g = torch.Generator().manual_seed(V + k)
    x = torch.randn(3, 5, V, generator=g)
    x[0, 0, 7] = x[0, 0, 11] = 50.0                      # a tie at the top
    x[1, 1] = float("-inf")                              # a row with nothing valid
    val, idx = chunked_topk(x, k, chunk=1024)
    ref_val, _ = x.topk(k, dim=-1)
    torch.testing.assert_close(val, ref_val, atol=0, rtol=0)
    assert int(idx.max()) < V
    finite = val.isfinite()
    torch.testing.assert_close(x.gather(-1, idx)[finite], val[finite], atol=0, rtol=0)
    assert (idx.sort(-1).values.diff(dim=-1)[finite[..., 1:]] != 0).all()   # distinct where valid
