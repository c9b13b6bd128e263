"""Pure-Python references for draft trees, shared by the tree builder's and the tree kernel's
tests: random logits of several kinds, the brute-force best prefixes, every structural invariant
of a built tree, and trees and target picks made to order."""
from __future__ import annotations

import itertools
import random

import torch

from drafttree.spec_decode.tree import DraftTree, ancestor_mask

ATOL = 1e-4
NEG_INF = float("-inf")


def log_probs(logits: torch.Tensor) -> list[list[float]]:
    """[L, V] logits of one request -> float64 log-probs."""
    return torch.log_softmax(logits.double(), dim=-1).tolist()


def brute_force_scores(lp: list[list[float]], budget: int) -> list[float]:
    """Scores of the top-`budget` prefixes of nonzero probability, descending."""
    scores = []
    for d in range(1, len(lp) + 1):
        for prefix in itertools.product(range(len(lp[0])), repeat=d):
            s = sum(lp[i][y] for i, y in enumerate(prefix))
            if s > NEG_INF:
                scores.append(s)
    return sorted(scores, reverse=True)[:budget]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= ATOL for x, y in zip(a, b))


def check_tree(tree: DraftTree, r: int, lp: list[list[float]], budget: int, root: int,
               exact_scores: list[float] | None) -> list[float]:
    """Structural invariants of row r; returns node scores in column order."""
    L, V = len(lp), len(lp[0])
    N = budget + 1
    tokens, parents = tree.tokens[r].tolist(), tree.parents[r].tolist()
    depth, valid = tree.depth[r].tolist(), tree.valid[r].tolist()
    assert len(tokens) == N
    assert (tokens[0], parents[0], depth[0], valid[0]) == (root, 0, 0, True)
    prefix: list[tuple[int, ...]] = [()]
    score, ancestors = [0.0], [{0}]
    n_valid = sum(valid) - 1
    assert all(valid[: n_valid + 1]) and not any(valid[n_valid + 1:])
    for j in range(1, N):
        p = parents[j]
        ancestors.append(ancestors[p] | {j})
        if not valid[j]:
            assert (tokens[j], p, depth[j]) == (0, 0, 1)
            continue
        assert 0 <= p < j and valid[p] and 0 <= tokens[j] < V
        assert depth[j] == depth[p] + 1 <= L
        prefix.append(prefix[p] + (tokens[j],))
        score.append(score[p] + lp[depth[j] - 1][tokens[j]])
        assert score[j] > NEG_INF
    assert len(set(prefix)) == len(prefix) == n_valid + 1
    for j in range(2, n_valid + 1):
        assert score[j] <= score[j - 1] + 1e-5
    expect_vis = torch.zeros(N, N, dtype=torch.bool)
    for i, anc in enumerate(ancestors):
        expect_vis[i, list(anc)] = True
    assert torch.equal(tree.visible[r], expect_vis)
    if exact_scores is not None:
        assert n_valid == len(exact_scores)
        assert close(sorted(score[1: n_valid + 1], reverse=True), exact_scores)
    return score


def make_logits(gen: torch.Generator, kind: str, R: int, L: int, V: int) -> torch.Tensor:
    """normal; integer (ties); dup (same distribution at every depth, tied values); uniform;
    peaked (log-probs of exactly 0: child ties parent); masked (-inf logits, zero-prob tokens)."""
    x = torch.randn(R, L, V, generator=gen)
    if kind == "normal":
        return x * (0.3 + 4 * torch.rand(1, generator=gen))
    if kind == "int":
        return torch.randint(-2, 3, (R, L, V), generator=gen).float()
    if kind == "dup":
        return (torch.randint(0, 3, (R, 1, V), generator=gen).float() * 0.7).expand(R, L, V)
    if kind == "masked":
        mask = (torch.rand(R, L, V, generator=gen) < 0.4) & (torch.arange(V) > 0)
        return x.masked_fill(mask, NEG_INF)[..., torch.randperm(V, generator=gen)]
    return {"uniform": x * 0, "peaked": x * 80}[kind]


KINDS = ["normal", "int", "dup", "uniform", "peaked", "masked"]


def path_picks(tree: DraftTree, r: int, node: int, pick: torch.Tensor) -> None:
    """Make the target's picks lead exactly to `node`."""
    while node != 0:
        parent = int(tree.parents[r, node])
        pick[r, parent] = tree.tokens[r, node]
        node = parent


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[DraftTree, int]:
    """Arbitrary topological tree, duplicate sibling tokens and invalid nodes allowed."""
    parents, depth = [0], [0]
    for j in range(1, n):
        p = rng.randrange(j)
        parents.append(p)
        depth.append(depth[p] + 1)
    tokens = torch.tensor([[rng.randrange(vocab) for _ in range(n)]])
    valid = torch.tensor([[True] + [rng.random() < 0.85 for _ in range(n - 1)]])
    par = torch.tensor([parents])
    return DraftTree(tokens, par, torch.tensor([depth]), valid, ancestor_mask(par, max(depth))), max(depth)
