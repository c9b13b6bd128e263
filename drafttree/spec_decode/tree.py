"""Draft trees for speculative decoding.

A drafter proposes, for each request, independent per-position distributions
q_1..q_L over the vocabulary. The score of a prefix (y_1..y_d) is
sum_i log q_i(y_i); the optimal draft tree of budget B is the set of the B
highest-scoring prefixes (depths 1..L), which is prefix-closed.

`build_tree` finds that set with static-shape tensor ops only (no host sync,
no data-dependent shapes), so it can be captured in a CUDA graph. The Python
loop it contains runs over the L depth levels, a fixed count. `accept` walks a
verified tree along the target's picks, likewise without host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafttree.kernels.dispatch import top_log_probs
from drafttree.kernels.fused import fused


@dataclass
class DraftTree:
    """A batch of draft trees with N = budget + 1 columns each.

    Column 0 is the root (the request's bonus token). Columns 1..N-1 are in
    best-first order: non-increasing score, and every parent precedes its
    children. Invalid nodes (fewer prefixes than budget) hold token 0, hang
    off the root (parent 0, depth 1) and see only themselves and the root.
    """

    tokens: torch.Tensor  # [R, N] long
    parents: torch.Tensor  # [R, N] long; parents[:, 0] == 0
    depth: torch.Tensor  # [R, N] long; depth[:, 0] == 0
    valid: torch.Tensor  # [R, N] bool; valid[:, 0] is True
    visible: torch.Tensor  # [R, N, N] bool; visible[r, i, j]: j is i or an ancestor of i

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def empty(cls, rows: int, N: int, device: torch.device | str) -> "DraftTree":
        """Trees of the root alone (the layout's invalid nodes past it): what tree buffers hold
        before a draft writes them, so that a step run over a row no round has written (a graph's
        warm-up over a parked row) walks a tree."""
        z = torch.zeros(rows, N, dtype=torch.long, device=device)
        depth = torch.ones(rows, N, dtype=torch.long, device=device)
        depth[:, 0] = 0
        valid = torch.zeros(rows, N, dtype=torch.bool, device=device)
        valid[:, 0] = True
        # not torch.eye: on the meta device (the memory plan's count) it imports torch's reference
        # ops and sympy, seconds of a start-up that compiles nothing
        visible = torch.zeros(rows, N, N, dtype=torch.bool, device=device)
        visible.diagonal(dim1=1, dim2=2).fill_(True)
        visible[:, :, 0] = True
        return cls(z, z.clone(), depth, valid, visible)

    def first(self, n: int) -> "DraftTree":
        """The tree of the first n columns (root and n - 1 nodes): best first with parents
        before children, so it is the best tree of budget n - 1, and still prefix-closed."""
        if n == self.num_nodes:
            return self
        return DraftTree(self.tokens[:, :n], self.parents[:, :n], self.depth[:, :n], self.valid[:, :n],
                         self.visible[:, :n, :n])


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """visible[r, i, j] = j is i or an ancestor of i, by pointer jumping.

    Requires parents[:, 0] == 0 and every node at depth <= max_depth.
    """
    R, N = parents.shape
    cur = torch.arange(N, device=parents.device).expand(R, N)
    vis = torch.zeros(R, N, N, dtype=torch.bool, device=parents.device)
    vis.scatter_(2, cur.unsqueeze(-1), True)
    for _ in range(max_depth):
        cur = parents.gather(1, cur)
        vis.scatter_(2, cur.unsqueeze(-1), True)
    return vis


def _pair_index(budget: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Static list of (slot, rank) pairs that can reach the top `budget`.

    With both the kept prefixes and the per-depth log-probs sorted descending,
    the candidate (slot i, rank j) is dominated by the (i+1)(j+1)-1 pairs
    (i' <= i, j' <= j); if (i+1)(j+1) > budget, at least `budget` other
    candidates score at least as high, so dropping it leaves the top-`budget`
    score multiset unchanged. This keeps about budget * ln(budget) pairs
    instead of budget * k.
    """
    m = sum(min(k, budget // s) for s in range(1, budget + 1))
    slots = torch.arange(budget, device=device)
    count = torch.clamp(budget // (slots + 1), max=k)
    first = count.cumsum(0) - count
    pair_slot = torch.repeat_interleave(slots, count, output_size=m)
    pair_rank = torch.arange(m, device=device) - first[pair_slot]
    return pair_slot, pair_rank


def check_tree_args(draft_logits: torch.Tensor, budget: int) -> tuple[int, int, int]:
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    R, L, V = draft_logits.shape
    if L < 1:
        raise ValueError("draft_logits needs at least one position")
    return R, L, V


def build_tree(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budget: int) -> DraftTree:
    """Optimal draft tree of `budget` nodes for each request.

    draft_logits: [R, L, V], any float dtype (computed in float32).
    root_tokens: [R], the bonus token each tree hangs from.

    Ties are broken shallower first, then by rank within a depth level, so
    the order is deterministic and topological even when a child scores
    exactly as high as its parent (a log-prob of 0). Prefixes of probability
    zero (from -inf logits) are never valid nodes.
    """
    R, L, V = check_tree_args(draft_logits, budget)
    device = draft_logits.device
    B, K = budget, min(budget, V)

    top_lp, top_idx = top_log_probs(draft_logits, K)

    # Each level keeps B prefixes sorted by descending score; slots that hold
    # no prefix have score -inf.
    score = F.pad(top_lp[:, 0], (0, B - K), value=float("-inf"))
    token = F.pad(top_idx[:, 0], (0, B - K), value=0)
    scores, tokens, parent_slots = [score], [token], [torch.zeros_like(token)]
    if L > 1:
        pair_slot, pair_rank = _pair_index(B, K, device)
        for d in range(1, L):
            cand = score[:, pair_slot] + top_lp[:, d, pair_rank]  # [R, M]
            score, pick = cand.topk(B, dim=-1)
            token = top_idx[:, d].gather(1, pair_rank[pick])
            scores.append(score)
            tokens.append(token)
            parent_slots.append(pair_slot[pick])
    return best_first(scores, tokens, parent_slots, root_tokens)[0]


def best_first(scores: list[torch.Tensor], tokens: list[torch.Tensor], parent_slots: list[torch.Tensor],
               root_tokens: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
    """The tree of the B best prefixes from L levels of them (level d: scores [R, B], descending,
    -inf where a slot holds none; tokens; parent slots at level d - 1), and its nodes' scores
    [R, B] (-inf at invalid nodes)."""
    R, B = scores[0].shape
    L = len(scores)
    device = scores[0].device
    # Flat index f = (depth - 1) * B + slot. A stable descending sort puts a
    # parent (smaller f, score >= child's) before its child, so the first B
    # entries are prefix-closed and topologically ordered.
    all_score = torch.stack(scores, dim=1).view(R, L * B)
    node_score, flat = torch.sort(all_score, dim=1, descending=True, stable=True)
    node_score, flat = node_score[:, :B], flat[:, :B]
    level = torch.div(flat, B, rounding_mode="floor")  # depth - 1
    node_token = torch.stack(tokens, dim=1).view(R, L * B).gather(1, flat)
    parent_slot = torch.stack(parent_slots, dim=1).view(R, L * B).gather(1, flat)

    cols = torch.arange(1, B + 1, device=device).expand(R, B)
    col_of_flat = torch.zeros(R, L * B, dtype=torch.long, device=device)
    col_of_flat.scatter_(1, flat, cols)
    parent_flat = ((level - 1) * B + parent_slot).clamp(min=0)
    parent_col = torch.where(level > 0, col_of_flat.gather(1, parent_flat), 0)

    valid = node_score > float("-inf")
    zero = torch.zeros(R, 1, dtype=torch.long, device=device)
    tree_tokens = torch.cat([root_tokens.long().view(R, 1), torch.where(valid, node_token, 0)], 1)
    parents = torch.cat([zero, torch.where(valid, parent_col, 0)], 1)
    depth = torch.cat([zero, torch.where(valid, level + 1, 1)], 1)
    valid = torch.cat([torch.ones(R, 1, dtype=torch.bool, device=device), valid], 1)
    return DraftTree(tree_tokens, parents, depth, valid, ancestor_mask(parents, L)), node_score


def chain_tree(draft_tokens: torch.Tensor, root_tokens: torch.Tensor) -> DraftTree:
    """The single chain root -> t_1 -> ... -> t_L (DFlash chain verification)."""
    R, L = draft_tokens.shape
    device = draft_tokens.device
    N = L + 1
    cols = torch.arange(N, device=device)
    tokens = torch.cat([root_tokens.long().view(R, 1), draft_tokens.long()], 1)
    parents = (cols - 1).clamp(min=0).expand(R, N).contiguous()
    depth = cols.expand(R, N).contiguous()
    valid = torch.ones(R, N, dtype=torch.bool, device=device)
    visible = (cols[None, :] <= cols[:, None]).expand(R, N, N).contiguous()
    return DraftTree(tokens, parents, depth, valid, visible)


@dataclass
class Acceptance:
    """Result of walking a draft tree along the target's picks.

    accept_len: [R] long, tau = accepted nodes counting the root (1..L+1).
    path: [R, L+1] long, column of the accepted node at depth d (path[:, 0]
        is the root, 0). Padding: for d >= tau-1, path[:, d] == path[:, tau-1],
        the deepest accepted node, repeated.
    tokens: [R, L+1] long, tokens[:, d] = target_pick[path[:, d]]; the first
        tau are committed this round and tokens[:, tau-1] is the next bonus
        token. By the padding of `path`, entries past tau-1 repeat the bonus.
    """

    accept_len: torch.Tensor
    path: torch.Tensor
    tokens: torch.Tensor


def accept(tree: DraftTree, target_pick: torch.Tensor, max_depth: int | None = None) -> Acceptance:
    """Walk from the root; while the target's pick at the current node equals
    the token of a valid child, move to that child (the lowest column one if
    several children share the token).

    target_pick: [R, N] long, the target's choice at every node.
    max_depth: L, the deepest level the tree can have (block_size - 1); the
        outputs have L+1 columns. Defaults to N-1, the deepest any tree of N
        nodes can be (exactly L for a `chain_tree`). Nodes deeper than
        max_depth are never accepted.
    """
    L = tree.tokens.shape[1] - 1 if max_depth is None else max_depth
    return Acceptance(*_walk(target_pick, tree.tokens, tree.parents, tree.valid, tree.visible, tree.depth, L))


@fused
def _walk(target_pick: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
          visible: torch.Tensor, depth: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept`'s walk: (accept_len, path, tokens); on CUDA one or two kernels, not ~25."""
    R, N = tokens.shape
    device = tokens.device
    pick = target_pick.long()
    cols = torch.arange(N, device=device)

    hit = valid & (tokens == pick.gather(1, parents)) & (cols > 0)
    # A node loses to an earlier matching sibling, so at most one child of
    # any node matches and the accepted nodes form a single root path.
    same_parent = parents.unsqueeze(2) == parents.unsqueeze(1)  # [R, i, j]
    earlier = cols.view(1, N) < cols.view(N, 1)  # j < i
    shadowed = (same_parent & earlier & hit.unsqueeze(1)).any(-1)
    match = (hit & ~shadowed) | (cols == 0)

    accepted = ~(visible & ~match.unsqueeze(1)).any(-1)
    accepted = accepted & (depth <= L)
    accept_len = accepted.sum(-1)

    levels = torch.arange(L + 1, device=device)
    at_level = accepted.unsqueeze(1) & (depth.unsqueeze(1) == levels.view(1, L + 1, 1))
    path = (at_level.long() * cols).sum(-1)  # [R, L+1]; 0 past the accepted depth
    clamp_at = torch.minimum(levels.view(1, L + 1), (accept_len - 1).view(R, 1))
    path = path.gather(1, clamp_at)
    return accept_len, path, pick.gather(1, path)
