"""The constrained round's draft tree, built on the host from the drafter's candidates.

The draft step leaves, per row, the top K tokens of each drafted position with their
log-probabilities. A node's grammar state depends on its path, so the tree is grown best first
over prefixes as `spec_decode.tree.build_tree` grows it (a prefix scores the sum of its tokens'
log-probabilities), except that a child must be allowed by its parent's grammar state: forbidden
tokens never enter the tree. A token the grammar forces (its only continuation) joins as a child
of probability 1 even where the drafter did not propose it. Each node's mask is its own state's:
the target's pick there is masked exactly as plain constrained decoding masks the position its
path reaches. DFlash's chain is the same walk with one child per node. Only the rows that follow a
grammar grow here: the batch's other rows verify the tree the device built from the same draft,
as in a free round, so the host's work follows the constrained rows, not the batch.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from drafttree.structured.grammar import ALL_ALLOWED, GrammarCompiler, Matcher, Thought

FORCED = -1   # a candidate the grammar forces, not among the drafter's top K


@dataclass
class HostTrees:
    """The trees of C batch rows (`rows`), W columns each (root and W - 1 nodes;
    `spec_decode.tree.DraftTree`'s layout: best first, parents before children, invalid nodes
    hanging off the root), of which the first N are grown (a round's verify width), with each
    one's mask. W is the tree buffers' width, so that the buffers hold one whole tree per row."""
    rows: np.ndarray       # [C] int64: the batch rows they are of
    tokens: np.ndarray     # [C, W] int64
    parents: np.ndarray    # [C, W] int64
    depth: np.ndarray      # [C, W] int64
    valid: np.ndarray      # [C, W] bool
    masks: np.ndarray      # [C, N, words] int32

    @classmethod
    def empty(cls, rows: list[int], W: int, N: int, words: int, masks: np.ndarray | None = None) -> "HostTrees":
        """`masks`: a buffer of at least C * N masks to hold them (else one is allocated)."""
        C = len(rows)
        z = lambda: np.zeros((C, W), dtype=np.int64)  # noqa: E731
        valid = np.zeros((C, W), dtype=bool)
        valid[:, 0] = True
        depth = z()
        depth[:, 1:] = 1
        masks = np.empty((C, N, words), dtype=np.int32) if masks is None else masks[:C * N].reshape(C, N, words)
        return cls(np.asarray(rows, dtype=np.int64), z(), z(), depth, valid, masks)

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


def grow(top_lp: np.ndarray, top_idx: np.ndarray, nodes: int, root: Matcher | Thought | None, chain: bool,
         eos_ids: set[int]) -> tuple[list[int], list[int], list[int], list]:
    """One row's tree below its root: (tokens, parents, depths, states) of up to `nodes` nodes
    (column 0, the root, excluded), best first. top_lp / top_idx [D, K]: the drafter's candidates
    at depths 1..D, log-probabilities descending. `root`: the grammar state after the committed
    tokens (None: unconstrained; a `Thought`: inside a reasoning the constraint leaves free, where
    a child needs only to be allowed by the reasoning's one mask, and the token that ends it is a
    leaf). `chain`: at most one child per node. `states`: each column's llguidance matcher (the
    root's included; None where unconstrained or inside the reasoning)."""
    # This loop runs per node of every constrained round on the host, between draft and verify:
    # plain lists and the matchers' own methods, not numpy scalars and wrappers.
    D, K = top_lp.shape
    lps, ids = top_lp.tolist(), top_idx.tolist()
    thought = root if isinstance(root, Thought) else None
    allowed, leaf = (thought.allowed, {thought.end, *eos_ids}) if thought is not None else (None, eos_ids)
    tokens, parents, depths = [0], [0], [0]
    states: list = [root.m if isinstance(root, Matcher) else None]
    scores = [0.0]
    children: list[set[int]] = [set()]
    heap: list[tuple[float, int, int, int]] = []   # (-score, order, node, rank or FORCED)
    order = itertools.count()
    push, pop, isfinite = heapq.heappush, heapq.heappop, math.isfinite

    def offer(node: int) -> None:
        d = depths[node]
        if d >= D or (node > 0 and tokens[node] in leaf):
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
        elif allowed is not None and not (tok < len(allowed) and allowed[tok]):
            continue
        kids.add(tok)
        tokens.append(tok)
        parents.append(node)
        depths.append(d + 1)
        states.append(child)
        scores.append(-neg)
        children.append(set())
        offer(len(tokens) - 1)
    return tokens[1:], parents[1:], depths[1:], states


def build_trees(top_lp: np.ndarray, top_idx: np.ndarray, roots: list[int], width: int, columns: int,
                matchers: list[Matcher | Thought | None], chain: bool, compiler: GrammarCompiler,
                eos_ids: set[int], masks: np.ndarray | None = None) -> HostTrees:
    """The trees of a constrained round's rows that follow a grammar (`matchers[b]` not None: its
    matcher, or its reasoning's `Thought` inside a reasoning the constraint leaves free) from the
    batch's candidates top_lp / top_idx [B, D, K] and roots: `width` columns (the root and up to
    width - 1 nodes, the round's verify width) grown, with every one's mask (computed in
    parallel; invalid nodes allow every token), in trees of `columns` columns; `masks`: a buffer
    of [at least C * width, words] to write the masks in (C: the constrained rows)."""
    rows = [b for b, m in enumerate(matchers) if m is not None]
    words = compiler.words
    out = HostTrees.empty(rows, columns, width, words, masks)
    jobs: list[tuple[object, int]] = []   # (llguidance matcher, mask row)
    for c, b in enumerate(rows):
        root = matchers[b]
        toks, pars, deps, states = grow(top_lp[b], top_idx[b], width - 1, root, chain, eos_ids)
        n = len(toks)
        out.tokens[c, 0] = roots[b]
        out.tokens[c, 1:1 + n] = toks
        out.parents[c, 1:1 + n] = pars
        out.depth[c, 1:1 + n] = deps
        out.valid[c, 1:1 + n] = True
        if isinstance(root, Thought):   # the reasoning's mask, and past its end the answer's first
            out.masks[c, :n + 1] = root.mask
            out.masks[c, 1:n + 1][out.tokens[c, 1:n + 1] == root.end] = root.after_end
        else:
            jobs += [(st, c * width + i) for i, st in enumerate(states)]
    flat = out.masks.reshape(-1, words)
    flat[~out.valid[:, :width].reshape(-1)] = ALL_ALLOWED
    compiler.fill_raw_masks(jobs, flat)
    return out
