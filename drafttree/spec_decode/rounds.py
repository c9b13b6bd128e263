"""One decoding round for rows 0..B-1, as pure device work on the static buffers of a
`RoundContext` (the runner owns it; CUDA graphs capture these functions over it).

decode: target forward of width 1; with a drafter, the token's features join the pending ones,
which a context phase writes into the drafter's cache before they could overflow their buffer
(every spec.width(CONTEXT) - 1 decode steps, not every step), or before a draft that follows more
plain rounds than it writes itself (its catch-up): the runner decides, host-side.
dflash / ddtree: draft (width block_size) -> chain or tree -> verify (width
spec.width(VERIFY, bucket, budget)) -> target picks -> acceptance walk -> commit (KV compaction, drafter
context, bonus). No host sync anywhere: the engine reads `out_tokens`/`out_n` afterwards.
"""
from __future__ import annotations

import torch

from drafttree.kernels import dispatch
from drafttree.kernels.fused import fused
from drafttree.models.dflash2 import DFlash2Drafter
from drafttree.models.kv_cache import attn_meta, page_slots
from drafttree.phases import Phase
from drafttree.sampling import SampleMode, pick_thresholds, pick_tokens
from drafttree.spec_decode.acceptance import observed, predicted
from drafttree.spec_decode.logits import commit_output, path_logprobs, process_logits
from drafttree.spec_decode.selector import selector_tree
from drafttree.spec_decode.state import RoundContext
from drafttree.spec_decode.tree import DraftTree, accept, build_tree, chain_tree
from drafttree.structured.masks import apply_token_masks


def decode_round(rc: RoundContext, B: int, kv_len: int, mode: SampleMode, masked: bool = False,
                 processed: bool = False) -> None:
    """One target token per row. With a drafter (speculation off for this round), the token's
    features are appended to the pending ones (`context_phase` writes them into its cache), so
    that drafting can resume at any round. `masked`: the pick takes column 0 of the grammar
    buffers' masks (a constrained batch). `processed`: the rows' logits processing before the
    pick, and the committed token's log-probabilities (`spec_decode.logits`)."""
    s = rc.state
    start, bonus = s.start[:B], s.bonus[:B]
    ones = torch.ones(B, 1, 1, dtype=torch.bool, device=start.device)
    meta = attn_meta(start, ones, kv_len, block_table=s.block_table[:B], page_size=rc.page_size)
    hidden, aux = rc.target(bonus[:, None], start[:, None], meta, rc.kv.k, rc.kv.v, rc.capture_layers)
    if rc.drafter is not None:
        _append_pending(s.ctx_n[:B], s.ctx_feat[:B], aux[:, 0])
    raw = logits = rc.target.logits(hidden)
    if masked:
        logits = apply_token_masks(logits, s.grammar.masks[:B, :1], in_place=not processed)
    if processed:   # the root alone: a tree of one node at depth 0
        zero = torch.zeros(B, 1, dtype=torch.long, device=start.device)
        logits = process_logits(logits, s.logits.rows(slice(0, B)), bonus[:, None], zero, zero, ones,
                                s.sampling.temperature[:B])
    picks = pick_tokens(logits, s.sampling, start[:, None] + 1, mode)[:, 0]
    if processed:
        lb = s.logits.rows(slice(0, B))
        path_logprobs(lb, raw, zero, picks[:, None])
        commit_output(lb, picks[:, None], zero[:, 0] + 1)
    s.out_tokens[:B, 0] = picks
    s.out_n[:B] = 1
    s.bonus[:B] = picks
    s.start[:B] += 1


@fused
def _append_pending(n: torch.Tensor, feat: torch.Tensor, new: torch.Tensor) -> None:
    """feat[b, n[b]] = new[b], n += 1, in place (compiled on CUDA). The runner runs a context
    phase before a full buffer; were its count ever wrong, the last pending feature would be
    overwritten (the drafter misses one position: a lower τ, the same tokens), never a write past
    the buffer."""
    at = n.clamp(max=feat.shape[1] - 1)
    feat[torch.arange(n.shape[0], device=n.device), at] = new.to(feat.dtype)
    n.copy_(at + 1)


def context_phase(rc: RoundContext, B: int) -> None:
    """Write rows 0..B-1's pending features into the drafter's cache. The last stays pending,
    moved to the buffer's front (ctx_n 1): a draft writes it again (the same value into the same
    slot) or a decode step appends after it, so ctx_n >= 1 always holds."""
    s = rc.state
    feat, pos = pending_context(rc, B, s.ctx_feat.shape[1])
    slots = page_slots(s.block_table[:B], pos, rc.page_size)
    rc.drafter.write_context(feat, pos, rc.dkv.k, rc.dkv.v, slots, torch.zeros_like(pos[:, :1]))
    _keep_last(s.ctx_n[:B], s.ctx_feat[:B])


@fused
def _keep_last(n: torch.Tensor, feat: torch.Tensor) -> None:
    """feat[b, 0] = feat[b, n[b] - 1], n = 1, in place."""
    feat[:, 0] = feat[torch.arange(n.shape[0], device=n.device), (n - 1).clamp(min=0)]
    n.fill_(1)


def pending_context(rc: RoundContext, B: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` features waiting for the drafter's cache and their positions, [B, width,
    F] and [B, width]: padded by repeating the last real one (same slot, same value)."""
    s = rc.state
    return _pending(s.start[:B], s.ctx_n[:B], s.ctx_feat[:B, :width])


@fused
def _pending(start: torch.Tensor, n: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, C, F = feat.shape
    idx = torch.minimum(torch.arange(C, device=start.device)[None, :], n[:, None] - 1)
    return feat.gather(1, idx[..., None].expand(B, C, F)), start[:, None] - n[:, None] + idx


@fused
def _block(start: torch.Tensor, bonus: torch.Tensor, ctx_pos: torch.Tensor, bs: int,
           mask_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft block's token ids [bonus, MASK, ...], positions, cache slots (context, then block)
    and its all-visible mask: on CUDA in one or two kernels, not seven."""
    col = torch.arange(bs, device=start.device)
    block_pos = start[:, None] + col
    block_ids = torch.where(col[None, :] == 0, bonus[:, None], mask_id)
    full = torch.ones(start.shape[0], bs, bs, dtype=torch.bool, device=start.device)
    return block_ids, block_pos, torch.cat([ctx_pos, block_pos], dim=1), full


def draft(rc: RoundContext, B: int, kv_len: int) -> torch.Tensor:
    """Write the new context into the drafter's cache and draft one block: [B, D, V] logits for
    block positions 1..D, D = spec.depth_at(batch bucket)."""
    return rc.drafter.draft_logits(draft_hidden(rc, B, kv_len), rc.spec.depth_at(rc.batch_bucket(B)))


def draft_hidden(rc: RoundContext, B: int, kv_len: int) -> torch.Tensor:
    """`draft` up to the drafter's final-normed hidden states of the block, [B, bs, D]."""
    s, spec, d = rc.state, rc.spec, rc.drafter
    start = s.start[:B]
    # a draft writes at most a verify's commits; more wait only after plain rounds, and then the
    # runner runs a context phase first
    ctx_feat, ctx_pos = pending_context(rc, B, spec.max_commit)
    block_ids, block_pos, slots, full = _block(start, s.bonus[:B], ctx_pos, spec.width(Phase.DRAFT),
                                               d.cfg.mask_token_id)
    meta = attn_meta(start, full, kv_len, slots=slots, block_table=s.block_table[:B], page_size=rc.page_size)
    return d(block_ids, block_pos, ctx_feat, ctx_pos, meta, rc.dkv.k, rc.dkv.v)


def make_tree(rc: RoundContext, draft_logits: torch.Tensor, B: int) -> DraftTree:
    """The tree (DDTree) or chain (DFlash) at the largest budget of the batch bucket:
    spec.width(VERIFY, bucket) nodes per row; a round at a smaller budget verifies its first
    budget + 1 (`verify_phase`). The width follows the batch bucket, so a graph and its eager
    fallback agree. The acceptance model's predictions at every budget go to state.out_pred."""
    bonus = rc.state.bonus[:B]
    width = rc.spec.width(Phase.VERIFY, rc.batch_bucket(B))
    if rc.spec.method == "ddtree":
        budget = width - 1   # nodes below the root, which is the bonus token
        tree = tree_builder(draft_logits.device, budget)(draft_logits, bonus, budget)
    else:
        tree = chain_tree(draft_logits.argmax(dim=-1), bonus)
    # shapes are host-known: no sync, and a capture records nothing for it
    assert tree.tokens.shape == (B, width), f"tree {tuple(tree.tokens.shape)} for {B} rows at verify width {width}"
    if rc.state.out_pred.shape[1]:
        rc.state.out_pred[:B] = predicted(draft_logits, tree, rc.spec.budgets)
    return tree


def tree_builder(device: torch.device, budget: int):
    """The DDTree builder a round uses: the fused kernel where it is the faster choice
    (`dispatch.fused_tree_usable`), else `build_tree`; both give a valid top-B tree."""
    if not dispatch.fused_tree_usable(device, budget):
        return build_tree

    def build_tree_fused(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budget: int) -> DraftTree:
        return DraftTree(*dispatch.build_tree_fused(draft_logits, root_tokens, budget))
    return build_tree_fused


def draft_phase(rc: RoundContext, B: int, kv_len: int) -> DraftTree:
    """Draft one block and shape it into the tree (or chain) to verify, kept in the round
    state's tree buffers (the verify phase reads it there); returns their view. A DFlash2
    drafter's comes from its selector's edges (`spec_decode.selector`)."""
    if isinstance(rc.drafter, DFlash2Drafter):
        return rc.state.store_tree(selector_tree(rc, draft_hidden(rc, B, kv_len), B))
    return rc.state.store_tree(make_tree(rc, draft(rc, B, kv_len), B))


def candidates_phase(rc: RoundContext, B: int, kv_len: int) -> None:
    """A constrained round's draft: one block drafted (context written as `draft` does), the top
    K tokens of each drafted position with their log-probabilities left in the grammar buffers,
    from which the host grows the trees of the rows that follow a grammar, and the free tree of
    every row in the tree buffers (as `draft_phase` leaves it), which the other rows verify; the
    acceptance model's predictions (of the free trees) go to state.out_pred."""
    g = rc.state.grammar
    if isinstance(rc.drafter, DFlash2Drafter):
        hidden = draft_hidden(rc, B, kv_len)
        logits = rc.drafter.draft_logits(hidden, rc.spec.depth_at(rc.batch_bucket(B)))
        rc.state.store_tree(selector_tree(rc, hidden, B, logits))
    else:
        logits = draft(rc, B, kv_len)
        # the grammar's effect on the acceptance (forced tokens accepted, forbidden drafts gone)
        # is left to the calibration, which observes the masked verify
        rc.state.store_tree(make_tree(rc, logits, B))
    D, K = logits.shape[1], g.cand_idx.shape[2]
    lp, idx = dispatch.top_log_probs(logits, K)
    g.cand_lp[:B, :D] = lp.float()
    g.cand_idx[:B, :D] = idx


def verify_forward(rc: RoundContext, B: int, kv_len: int, tree: DraftTree, mode: SampleMode, masked: bool = False,
                   processed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target forward over the tree; returns the target's pick at every node (`masked`: each
    node's logits masked by its grammar mask first; `processed`: processed along each node's
    path, `spec_decode.logits`), the features of every node and the target's own logits."""
    s = rc.state
    start = s.start[:B]
    # node i sits in cache slot start+i, at rope position start+depth(i)
    pos = start[:, None] + tree.depth
    meta = attn_meta(start, tree.visible, kv_len, block_table=s.block_table[:B], page_size=rc.page_size)
    hidden, aux = rc.target(tree.tokens, pos, meta, rc.kv.k, rc.kv.v, rc.capture_layers)
    raw = logits = rc.target.logits(hidden)
    if masked:
        logits = apply_token_masks(logits, s.grammar.masks[:B, :tree.num_nodes], in_place=not processed)
    if processed:
        logits = process_logits(logits, s.logits.rows(slice(0, B)), tree.tokens, tree.parents, tree.depth,
                                tree.visible, s.sampling.temperature[:B])
    observe = s.out_seen.shape[1]   # what the target's sampler gives the tree, for the budget choice
    thr = pick_thresholds(logits, s.sampling, mode) if observe else None   # one top-k/top-p pass for both
    picks = pick_tokens(logits, s.sampling, pos + 1, mode, thr)
    if observe:
        s.out_seen[:B] = observed(logits, tree, picks, s.sampling, mode, thr, rc.spec.budgets)
    return picks, aux, raw


def accept_commit(rc: RoundContext, B: int, tree: DraftTree, picks: torch.Tensor, aux: torch.Tensor,
                  raw: torch.Tensor | None = None) -> None:
    """Walk the tree along the picks and commit the accepted path; with the target's logits `raw`
    (a processed round), also the committed tokens' log-probabilities and the rows' output state."""
    acc = accept(tree, picks, rc.spec.depth)
    if raw is not None:
        lb = rc.state.logits.rows(slice(0, B))
        path_logprobs(lb, raw, acc.path, acc.tokens)
        commit_output(lb, acc.tokens, acc.accept_len)
    commit(rc, B, acc.path, acc.accept_len, acc.tokens, aux)


def verify_phase(rc: RoundContext, B: int, kv_len: int, mode: SampleMode, budget: int | None = None,
                 masked: bool = False, processed: bool = False) -> None:
    """Verify the tree the draft phase left in the round state at `budget` (default: the
    bucket's largest, the tree's own): its first budget + 1 columns, the best tree of that budget.
    `masked`: a constrained round's tree and masks, which the host wrote there. `processed`: the
    rows' logits processed per node, and log-probabilities of what commits."""
    width = rc.spec.width(Phase.VERIFY, rc.batch_bucket(B), budget)
    tree = rc.state.tree_at(B, width)
    assert tree.num_nodes == width, f"a tree of {tree.num_nodes} nodes for verify width {width}"
    picks, aux, raw = verify_forward(rc, B, kv_len, tree, mode, masked, processed)
    accept_commit(rc, B, tree, picks, aux, raw if processed else None)


def spec_round(rc: RoundContext, B: int, kv_len: int, mode: SampleMode, budget: int | None = None) -> None:
    draft_phase(rc, B, kv_len)
    verify_phase(rc, B, kv_len, mode, budget)


def prefill_forward(rc: RoundContext, ids: torch.Tensor, pos: torch.Tensor, meta, at: torch.Tensor,
                    keep: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One prefill forward of the target over [n, W] tokens at positions `pos`, the drafter's
    context written from it (with a drafter) at the same slots; returns the hidden state and the
    drafter features at column at[b] of each row (`keep`: the whole hidden state [n, W, D] is
    appended to it, for prompt log-probabilities). Features past a chunk's end are padding,
    written where the cache is masked."""
    hidden, aux = rc.target(ids, pos, meta, rc.kv.k, rc.kv.v, rc.capture_layers)
    if keep is not None:
        keep.append(hidden)
    rows = torch.arange(ids.shape[0], device=ids.device)
    if rc.drafter is None:
        return hidden[rows, at], None
    rc.drafter.write_context(aux, pos, rc.dkv.k, rc.dkv.v, slots=meta.slots, rows=meta.rows)
    return hidden[rows, at], aux[rows, at]


def commit(rc: RoundContext, B: int, path: torch.Tensor, tau: torch.Tensor, tokens: torch.Tensor,
           aux: torch.Tensor) -> None:
    """Keep the accepted path: its K/V move to positions start..start+tau-1 (pool slots through
    the row's block table: the verify's nodes sit in the pages reserved for the round's width,
    so only those entries move), its features become the drafter's next context, the last pick
    becomes the bonus."""
    s = rc.state
    start, table = s.start[:B], s.block_table[:B]
    dst = start[:, None] + torch.arange(path.shape[1], device=path.device)
    rc.kv.compact(page_slots(table, start[:, None] + path, rc.page_size), page_slots(table, dst, rc.page_size))
    s.ctx_feat[:B, :path.shape[1]] = aux.gather(1, path[..., None].expand(-1, -1, aux.shape[2])).to(s.ctx_feat.dtype)
    s.ctx_n[:B] = tau
    s.out_tokens[:B] = tokens
    s.out_n[:B] = tau
    s.bonus[:B] = tokens.gather(1, (tau - 1)[:, None])[:, 0]
    s.start[:B] += tau
