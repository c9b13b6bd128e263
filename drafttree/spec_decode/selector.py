"""DFlash2's draft (`models.dflash2`): the selector's edge scores into the chain or the tree a
round verifies.

The selector scores, for each drafted position i, the K candidates after each candidate of
position i - 1 (the anchor before position 1): a first-order Markov chain over the candidates,
q_i(c | p) = softmax_c S_i(p, c). The DFlash chain is its greedy walk from the anchor; the DDTree
tree is the `budget` most probable prefixes under it. Either way the target picks every token at
verify, so the proposal decides how many tokens a round accepts, never which.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from drafttree.kernels.fused import fused
from drafttree.phases import Phase
from drafttree.spec_decode.acceptance import expected_from_scores, predictions_at
from drafttree.spec_decode.state import RoundContext
from drafttree.spec_decode.tree import DraftTree, best_first, chain_tree


def selector_chain(cand: torch.Tensor, scores: torch.Tensor, root_tokens: torch.Tensor
                   ) -> tuple[DraftTree, torch.Tensor]:
    """The greedy walk: at each position the best edge from the candidate chosen before (ties to
    the lower candidate index). cand [R, D, K], scores [R, D, K, K]; returns the chain and its
    nodes' path log-probabilities [R, D]."""
    tokens, path = _chain_walk(cand, scores)
    return chain_tree(tokens, root_tokens), path


@fused
def _chain_walk(cand: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`selector_chain`'s tokens [R, D] and path log-probabilities [R, D]: a few small ops per
    position, one compiled piece."""
    R, D, K = cand.shape
    lp = scores.float().log_softmax(-1)
    at = torch.zeros(R, 1, 1, dtype=torch.long, device=cand.device)   # position 1: the anchor's row
    total = torch.zeros(R, 1, device=cand.device)
    tokens, path = [], []
    for d in range(D):
        row = lp[:, d].gather(1, at.expand(R, 1, K))[:, 0]               # [R, K]
        best = row.argmax(dim=-1, keepdim=True)
        total = total + row.gather(1, best)
        tokens.append(cand[:, d].gather(1, best))
        path.append(total)
        at = best[:, :, None]
    return torch.cat(tokens, 1), torch.cat(path, 1)


def build_selector_tree(cand: torch.Tensor, scores: torch.Tensor, root_tokens: torch.Tensor, budget: int
                        ) -> tuple[DraftTree, torch.Tensor]:
    """The best tree of `budget` nodes under the selector's chain: level by level, each of the B
    best prefixes extends by its own row of K candidates and the best B extensions stay; then the
    levels merge best first, parents before children (`tree.best_first`). cand [R, D, K], scores
    [R, D, K, K]; returns the tree and its nodes' path log-probabilities [R, budget]."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    levels, tokens, parents = _beam_levels(cand, scores, budget)
    return best_first(list(levels.unbind(1)), list(tokens.unbind(1)), list(parents.unbind(1)), root_tokens)


@fused
def _beam_levels(cand: torch.Tensor, scores: torch.Tensor, B: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`build_selector_tree`'s levels: scores, tokens and parent slots [R, D, B], a top-k and a
    few small ops per level, one compiled piece."""
    R, D, K = cand.shape
    lp = scores.float().log_softmax(-1)
    k0 = min(B, K)
    score, at = lp[:, 0, 0].topk(k0, dim=-1)
    score, at = F.pad(score, (0, B - k0), value=float("-inf")), F.pad(at, (0, B - k0), value=0)
    levels, tokens, parents = [score], [cand[:, 0].gather(1, at)], [torch.zeros_like(at)]
    for d in range(1, D):
        rows = lp[:, d].gather(1, at[:, :, None].expand(R, B, K))          # [R, B, K]
        score, pick = (score[:, :, None] + rows).view(R, B * K).topk(B, dim=-1)
        at = pick % K
        levels.append(score)
        tokens.append(cand[:, d].gather(1, at))
        parents.append(torch.div(pick, K, rounding_mode="floor"))
    return torch.stack(levels, 1), torch.stack(tokens, 1), torch.stack(parents, 1)


def selector_tree(rc: RoundContext, hidden: torch.Tensor, B: int, logits: torch.Tensor | None = None) -> DraftTree:
    """`rounds.make_tree` for a DFlash2 drafter, from the draft block's hidden states [B, bs, D]
    (and its unary logits, where the caller has them): the chain (DFlash) or the tree (DDTree) at
    the batch bucket's verify width, and the acceptance model's predictions at every budget in
    state.out_pred."""
    spec, bucket = rc.spec, rc.batch_bucket(B)
    bonus = rc.state.bonus[:B]
    cand, scores = rc.drafter.edge_scores(hidden, bonus, spec.depth_at(bucket), logits)
    width = spec.width(Phase.VERIFY, bucket)
    if spec.method == "ddtree":
        tree, node_lp = build_selector_tree(cand, scores, bonus, width - 1)
    else:
        tree, node_lp = selector_chain(cand, scores, bonus)
    assert tree.tokens.shape == (B, width), f"tree {tuple(tree.tokens.shape)} for {B} rows at verify width {width}"
    if rc.state.out_pred.shape[1]:
        rc.state.out_pred[:B] = predictions_at(expected_from_scores(node_lp), spec.budgets)
    return tree
