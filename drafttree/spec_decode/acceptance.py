"""The acceptance model: the accepted length a draft tree is expected to give, from the drafter's
own per-position distributions, at every budget up to the tree's.

If the target accepted the drafter's token at depth d with the drafter's probability
q_d(y_d), independently per position, a node would be accepted with the product of the
probabilities along its path, and the expected accepted length of a tree (root counted, as τ
counts the bonus token) is 1 + the sum of those products over its nodes: the DDTree objective.
The tree builder orders nodes best first and every parent precedes its children, so the first
b nodes are the best tree of budget b, and the cumulative sum at column b is the prediction for
budget b. A DFlash chain is a tree whose nodes are in depth order: the same sum gives its
prefix products.

What the round then saw (`observed_accept`): the same sum over the verified tree with the
target's own acceptance of each node, the probability that its pick at the node's parent is the
node's token, under the row's sampler (temperature, top-k, top-p; for a greedy row 1 where the
parent's argmax is the token, else 0, which gives the realised τ). Its column b is the expected τ
the target's sampler gives the tree's first b nodes: an observation of every budget up to the one
verified from one round, with none of a sampled τ's noise. The engine calibrates the
predictions against these (`engine.budget`).
"""
from __future__ import annotations

import torch

from drafttree.kernels.fused import fused
from drafttree.sampling import SampleMode, SamplingTensors, at_temperature, pick_thresholds
from drafttree.spec_decode.tree import DraftTree

# Predictions travel to the host in the round's integer output buffer, in thousandths of a token.
PRED_SCALE = 1000


def expected_accept(draft_logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """[R, N] float32: column n is the expected accepted length of the tree's first n + 1
    columns (root and n nodes); column 0 is 1. draft_logits: [R, D, V], positions 1..D."""
    return _expected(draft_logits, tree.tokens, tree.depth, tree.valid, tree.visible)


def predicted(draft_logits: torch.Tensor, tree: DraftTree, budgets: tuple[int, ...]) -> torch.Tensor:
    """`predictions_at(expected_accept(...))`, compiled on CUDA into a few kernels: a drafting
    round of the adaptive choice pays for these in every round, which a fixed budget does not."""
    return _predicted(draft_logits, tree.tokens, tree.depth, tree.valid, tree.visible, budgets)


def _expected(draft_logits: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor,
              visible: torch.Tensor) -> torch.Tensor:
    R, D, V = draft_logits.shape
    logits = draft_logits.float()
    lse = torch.logsumexp(logits, dim=-1)                             # [R, D]
    at = (depth[:, 1:] - 1).clamp(0, D - 1)                           # node i uses q_{depth(i)}
    flat = at * V + tokens[:, 1:]
    lp = logits.view(R, D * V).gather(1, flat) - lse.gather(1, at)    # [R, N-1]
    return _path_sums(lp, valid, visible)


@fused
def _predicted(draft_logits: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor,
               visible: torch.Tensor, budgets: tuple[int, ...]) -> torch.Tensor:
    return predictions_at(_expected(draft_logits, tokens, depth, valid, visible), budgets)


def observed_accept(logits: torch.Tensor, tree: DraftTree, picks: torch.Tensor, st: SamplingTensors,
                    mode: SampleMode, thr: torch.Tensor | None = None) -> torch.Tensor:
    """[R, N] float32: column n is the expected accepted length of the verified tree's first
    n + 1 columns under the target's sampler (see the module's docstring); logits [R, N, V] are
    the target's at the nodes, picks [R, N] its picks there."""
    return _seen(*_seen_inputs(logits, tree, picks, st, mode, thr))


def observed(logits: torch.Tensor, tree: DraftTree, picks: torch.Tensor, st: SamplingTensors, mode: SampleMode,
             thr: torch.Tensor | None, budgets: tuple[int, ...]) -> torch.Tensor:
    """`observed_at(observed_accept(...))`, compiled on CUDA into a few kernels (as `predicted`)."""
    return _observed(*_seen_inputs(logits, tree, picks, st, mode, thr), budgets)


def _seen_inputs(logits: torch.Tensor, tree: DraftTree, picks: torch.Tensor, st: SamplingTensors, mode: SampleMode,
                 thr: torch.Tensor | None) -> tuple:
    """`_seen`'s arguments: a greedy batch's without log-probabilities (its walk is the picks')."""
    lp = temp = None
    if mode is not SampleMode.GREEDY:
        temp = st.temperature[:logits.shape[0]]
        thr = thr if thr is not None else pick_thresholds(logits, st, mode)   # the pick's, where it passed them
        lp = _sampled_log_probs(logits, temp, tree.parents[:, 1:], tree.tokens[:, 1:], thr)
    return picks, lp, temp, tree.parents, tree.tokens, tree.valid, tree.visible


def _seen(picks: torch.Tensor, lp: torch.Tensor | None, temp: torch.Tensor | None, parents: torch.Tensor,
          tokens: torch.Tensor, valid: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    hit = torch.where(picks.gather(1, parents[:, 1:]) == tokens[:, 1:], 0.0, -1e4)   # a greedy row: the walk itself
    if lp is not None:   # a sampled batch's rows at temperature 0 are greedy rows
        hit = torch.where((temp > 0)[:, None], lp, hit)
    return _path_sums(hit, valid, visible)


@fused
def _observed(picks: torch.Tensor, lp: torch.Tensor | None, temp: torch.Tensor | None, parents: torch.Tensor,
              tokens: torch.Tensor, valid: torch.Tensor, visible: torch.Tensor,
              budgets: tuple[int, ...]) -> torch.Tensor:
    return observed_at(_seen(picks, lp, temp, parents, tokens, valid, visible), budgets)


@fused
def _sampled_log_probs(logits: torch.Tensor, temp: torch.Tensor, parent: torch.Tensor, tok: torch.Tensor,
                       thr: torch.Tensor | None) -> torch.Tensor:
    """log P(the pick at node parent[r, i] is tok[r, i]) under sampling at temp [R] (over the
    logits >= thr, where given): [R, N - 1]. Compiled on CUDA into one reduction over the logits,
    which are not copied at the temperature."""
    R, N, V = logits.shape
    scaled = at_temperature(logits, temp)
    if thr is not None:
        scaled = torch.where(logits >= thr[..., None], scaled, float("-inf"))
    lse = torch.logsumexp(scaled, dim=-1)                                 # [R, N]
    return scaled.reshape(R, N * V).gather(1, parent * V + tok) - lse.gather(1, parent)


def _path_sums(lp: torch.Tensor, valid: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """1, then 1 + the cumulative sum over nodes 1.. of exp(the sum of lp [R, N-1] down each
    node's path): the expected accepted length at every column."""
    R = lp.shape[0]
    # invalid nodes score nothing; a finite floor keeps 0 * floor finite in the path sums below
    lp = torch.where(valid[:, 1:], lp, -1e4).clamp(min=-1e4)
    # log P(path to node): a masked sum, not a matmul, so that a compiled piece fuses it
    path = torch.where(visible[:, 1:, 1:], lp[:, None, :], 0.0).sum(-1)
    gain = torch.where(valid[:, 1:], path.exp(), 0.0)
    return torch.cat([torch.ones(R, 1, device=gain.device), 1.0 + gain.cumsum(1)], dim=1)


def expected_from_scores(node_lp: torch.Tensor) -> torch.Tensor:
    """`expected_accept` from the nodes' path log-probabilities [R, N-1] (best first; -inf at
    invalid nodes), for drafters whose distributions are not per position (DFlash2's selector)."""
    gain = node_lp.float().exp()
    return torch.cat([torch.ones(gain.shape[0], 1, device=gain.device), 1.0 + gain.cumsum(1)], dim=1)


def predictions_at(values: torch.Tensor, budgets: tuple[int, ...]) -> torch.Tensor:
    """[R, len(budgets)] long, in 1/PRED_SCALE tokens: the prediction at each budget, taken at
    the tree's last column for budgets past it (a bucket whose tree is narrower never runs them)."""
    # column slices, not an index tensor: a host-to-device copy cannot be captured in a graph
    last = values.shape[1] - 1
    picked = torch.stack([values[:, min(b, last)] for b in budgets], dim=1)
    return (picked * PRED_SCALE).round().long()


def observed_at(values: torch.Tensor, budgets: tuple[int, ...]) -> torch.Tensor:
    """As `predictions_at`, 0 at budgets past the verified tree (nothing was seen there)."""
    last = values.shape[1] - 1
    zero = torch.zeros_like(values[:, 0])
    picked = torch.stack([values[:, b] if b <= last else zero for b in budgets], dim=1)
    return (picked * PRED_SCALE).round().long()
