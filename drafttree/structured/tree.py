"""The constrained round's draft tree, built on the host from the drafter's candidates.

The draft step leaves, per row, the top K tokens of each drafted position with their
log-probabilities. A node's grammar state depends on its path, so the tree is grown best first
over prefixes as `spec_decode.tree.build_tree` grows it (a prefix scores the sum of its tokens'
log-probabilities), except that a child must be allowed by its parent's grammar state: forbidden
tokens never enter the tree. A token the grammar forces (its only continuation) joins as a child
of probability 1 even where the drafter did not propose it. Each node's mask is its own state's:
the target's pick there is masked exactly as plain constrained decoding masks the position its
path reaches. Unconstrained rows of the batch grow their trees the same way, all tokens allowed.
DFlash's chain is the same walk with one child per node.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from drafttree.structured.grammar import ALL_ALLOWED, GrammarCompiler, Matcher

FORCED = -1   # a candidate the grammar forces, not among the drafter's top K


@dataclass
class HostTrees:
    """B trees of W columns (root and W - 1 nodes; `spec_decode.tree.DraftTree`'s layout: best
    first, parents before children, invalid nodes hanging off the root) and each node's mask."""
    tokens: np.ndarray     # [B, W] int64
    parents: np.ndarray    # [B, W] int64
    depth: np.ndarray      # [B, W] int64
    valid: np.ndarray      # [B, W] bool
    masks: np.ndarray      # [B, W, words] int32

    @classmethod
    def empty(cls, B: int, W: int, words: int) -> "HostTrees":
        z = lambda: np.zeros((B, W), dtype=np.int64)  # noqa: E731
        valid = np.zeros((B, W), dtype=bool)
        valid[:, 0] = True
        depth = z()
        depth[:, 1:] = 1
        return cls(z(), z(), depth, valid, np.full((B, W, words), ALL_ALLOWED, dtype=np.int32))

    def visible(self) -> np.ndarray:
        """[B, W, W] bool: j is i or an ancestor of i."""
        B, W = self.parents.shape
        vis = np.zeros((B, W, W), dtype=bool)
        cur = np.broadcast_to(np.arange(W), (B, W)).copy()
        rows = np.arange(B)[:, None]
        cols = np.arange(W)[None, :]
        vis[rows, cols, cur] = True
        for _ in range(int(self.depth.max(initial=0))):
            cur = np.take_along_axis(self.parents, cur, 1)
            vis[rows, cols, cur] = True
        return vis


def grow(top_lp: np.ndarray, top_idx: np.ndarray, nodes: int, root: Matcher | None, chain: bool,
         eos_ids: set[int]) -> tuple[list[int], list[int], list[int], list]:
    """One row's tree below its root: (tokens, parents, depths, states) of up to `nodes` nodes
    (column 0, the root, excluded), best first. top_lp / top_idx [D, K]: the drafter's candidates
    at depths 1..D, log-probabilities descending. `root`: the grammar state after the committed
    tokens (None: unconstrained). `chain`: at most one child per node. `states`: each column's
    llguidance matcher (the root's included; None where unconstrained)."""
    # This loop runs per node of every constrained round on the host, between draft and verify:
    # plain lists and the matchers' own methods, not numpy scalars and wrappers.
    D, K = top_lp.shape
    lps, ids = top_lp.tolist(), top_idx.tolist()
    tokens, parents, depths = [0], [0], [0]
    states: list = [root.m if root is not None else None]
    scores = [0.0]
    children: list[set[int]] = [set()]
    heap: list[tuple[float, int, int, int]] = []   # (-score, order, node, rank or FORCED)
    order = itertools.count()
    push, pop, isfinite = heapq.heappush, heapq.heappop, math.isfinite

    def offer(node: int) -> None:
        d = depths[node]
        if d >= D or (node > 0 and tokens[node] in eos_ids):
            return
        push(heap, (-(scores[node] + lps[d][0]), next(order), node, 0))
        st = states[node]
        if st is not None:
            forced = st.compute_ff_tokens()
            if forced:
                push(heap, (-scores[node], next(order), node, FORCED - forced[0]))

    offer(0)
    while heap and len(tokens) <= nodes:
        neg, _, node, rank = pop(heap)
        d = depths[node]
        kids = children[node]
        if rank >= 0:
            lp_d = lps[d]
            tok = ids[d][rank]
            if rank + 1 < K and not (chain and kids):
                push(heap, (-(scores[node] + lp_d[rank + 1]), next(order), node, rank + 1))
            if not isfinite(lp_d[rank]):
                continue
        else:
            tok = FORCED - rank
        if tok in kids or (chain and kids):
            continue
        st = states[node]
        child = None
        if st is not None:
            if st.validate_tokens([tok]) != 1:
                continue
            child = st.deep_copy()
            child.consume_token(tok)
        kids.add(tok)
        tokens.append(tok)
        parents.append(node)
        depths.append(d + 1)
        states.append(child)
        scores.append(-neg)
        children.append(set())
        offer(len(tokens) - 1)
    return tokens[1:], parents[1:], depths[1:], states


def build_trees(top_lp: np.ndarray, top_idx: np.ndarray, roots: list[int], width: int,
                matchers: list[Matcher | None], chain: bool, compiler: GrammarCompiler | None,
                eos_ids: set[int], rows: int | None = None) -> HostTrees:
    """The trees of a constrained round: rows 0..B-1 (B = len(roots)) from their candidates
    top_lp / top_idx [B, D, K], `width` columns each; rows B..rows-1 (parked rows of the batch
    bucket) hold a root alone. Masks: each constrained node's state's, computed in parallel;
    every other entry allows every token."""
    B = len(roots)
    words = compiler.words if compiler is not None else 1
    out = HostTrees.empty(rows or B, width, words)
    jobs: list[tuple[object, int]] = []   # (llguidance matcher, mask row)
    for b in range(B):
        toks, pars, deps, states = grow(top_lp[b], top_idx[b], width - 1, matchers[b], chain, eos_ids)
        n = len(toks)
        out.tokens[b, 0] = roots[b]
        out.tokens[b, 1:1 + n] = toks
        out.parents[b, 1:1 + n] = pars
        out.depth[b, 1:1 + n] = deps
        out.valid[b, 1:1 + n] = True
        if matchers[b] is not None:
            jobs += [(st, b * width + i) for i, st in enumerate(states) if st is not None]
    if jobs:
        compiler.fill_raw_masks(jobs, out.masks.reshape(-1, words))
    return out
