"""What a round reads and writes: the per-row device state kept between rounds (static
buffers) and `RoundContext`, everything the round functions take, which the runner owns."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashDrafter
from drafttree.models.kv_cache import NULL_PAGE, PagedKVCache
from drafttree.phases import SpecConfig, batch_bucket
from drafttree.sampling import SamplingTensors
from drafttree.spec_decode.logits import LogitsBuffers
from drafttree.spec_decode.tree import DraftTree


@dataclass
class RoundState:
    """Row b: committed tokens x[0:start[b]) have K/V in the cache; bonus[b] is the target's
    pick at position start[b], not yet run through the target. For a drafter, the features of
    the last ctx_n[b] committed positions (start-ctx_n .. start-1) wait in ctx_feat[b, :ctx_n]
    to be written into its context cache (ctx_n >= 1 between rounds, and start >= ctx_n: those
    slots exist; the cache kernels do no bounds checks, and a slot of -1 would write before the
    row). A verify leaves up to C there, each decode step one more, a context phase one (the
    last, which the next draft writes again: the same value into the same slot)."""
    start: torch.Tensor          # [R] long
    bonus: torch.Tensor          # [R] long
    ctx_feat: torch.Tensor       # [R, K, n*D]; K = spec.width(CONTEXT): what one context phase writes
    ctx_n: torch.Tensor          # [R] long
    sampling: SamplingTensors
    out: torch.Tensor            # [R, 1 + C + 2P] long: how many tokens the last round committed,
                                 # those tokens (C = spec.max_commit), then the acceptance model's
                                 # predictions at the P budgets of spec.budgets and the expected τ
                                 # the target's sampler gave the verified tree at those budgets
                                 # (a drafting round's; one buffer: the engine copies it to the
                                 # host as is)
    block_table: torch.Tensor    # [R, N] long: row b's pages, position j in page block_table[b, j // page_size];
                                 # N = pages of max_model_len + kv_headroom; unused entries: the null page
    tree: DraftTree | None = None   # [R, T] (visible [R, T, T]): the draft phase's tree, which the verify
                                 # phase reads (a verify graph replays after any draft that wrote it);
                                 # T = spec.verify_width_max; None without speculation
    grammar: GrammarBuffers | None = None   # a constrained round's inputs and outputs (structured output)
    # processed rounds' per-row state (penalties, bias, banned sequences) and their log-probabilities;
    # written whole when a row's prefill ends, moved by the runner (not by copy_row, not in a snapshot:
    # only processed steps read it, and what capture leaves in parked rows is never read)
    logits: LogitsBuffers | None = None
    commit: int = 0              # C: the committed tokens' columns of `out`

    @property
    def out_n(self) -> torch.Tensor:      # [R]
        return self.out[:, 0]

    @property
    def out_tokens(self) -> torch.Tensor:  # [R, C]
        return self.out[:, 1:1 + self.commit]

    @property
    def out_pred(self) -> torch.Tensor:    # [R, P], in 1/acceptance.PRED_SCALE tokens
        P = (self.out.shape[1] - 1 - self.commit) // 2
        return self.out[:, 1 + self.commit:1 + self.commit + P]

    @property
    def out_seen(self) -> torch.Tensor:    # [R, P], as out_pred; 0 past the verified budget
        P = (self.out.shape[1] - 1 - self.commit) // 2
        return self.out[:, 1 + self.commit + P:]

    @classmethod
    def allocate(cls, rows: int, commit: int, feat_dim: int, dtype: torch.dtype,
                 device: torch.device | str, pages_per_row: int, predictions: int = 0,
                 tree_width: int = 0, pending: int = 0) -> "RoundState":
        """`commit`: tokens a round commits per row at most; `pending`: drafter features a row
        may hold unwritten (default `commit`)."""
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        tree = None
        if tree_width:
            tree = DraftTree.empty(rows, tree_width, device)
        pending = pending or commit
        state = cls(z(rows), z(rows), torch.zeros(rows, pending, max(feat_dim, 1), dtype=dtype, device=device),
                    z(rows), SamplingTensors.empty(rows, device), z(rows, 1 + commit + 2 * predictions),
                    z(rows, pages_per_row), tree, commit=commit)
        state.park(0, rows)
        return state

    def store_tree(self, tree: DraftTree) -> DraftTree:
        """Keep the draft phase's tree for rows 0..B-1 (B, W: its shape) in the tree buffers;
        returns the view the verify phase reads (`tree_at`)."""
        B, W = tree.tokens.shape
        assert self.tree is not None and W <= self.tree.num_nodes, \
            f"a tree of {W} nodes for tree buffers of {0 if self.tree is None else self.tree.num_nodes}"
        _store_tree(self.tree, tree, B, W)
        return self.tree_at(B, W)

    def tree_at(self, B: int, width: int) -> DraftTree:
        """The stored tree's first `width` columns for rows 0..B-1 (views: no copy)."""
        t = self.tree
        return DraftTree(t.tokens[:B, :width], t.parents[:B, :width], t.depth[:B, :width], t.valid[:B, :width],
                         t.visible[:B, :width, :width])

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer a round writes (K/V aside): what `snapshot` keeps."""
        out = [self.start, self.bonus, self.ctx_feat, self.ctx_n, self.out, self.block_table]
        if self.tree is not None:
            t = self.tree
            out += [t.tokens, t.parents, t.depth, t.valid, t.visible]
        return out

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the round state, for `restore` (capture and timing run rounds on it)."""
        return [t.clone() for t in self.tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, v in zip(self.tensors(), saved, strict=True):
            t.copy_(v)

    def park(self, b: int, B: int) -> None:
        """Rows b..B-1 hold no request: a harmless state that a round may run on (no host sync).
        One committed token, whose feature is the drafter's context: its slot is 0. Their block
        tables point at the null page only: a parked row never writes a request's pages."""
        if b < B:
            self.start[b:B].fill_(1)
            self.bonus[b:B].zero_()
            self.ctx_n[b:B].fill_(1)
            self.block_table[b:B].fill_(NULL_PAGE)

    def copy_row(self, src: int, dst: int) -> None:
        # the tree is rewritten by every draft phase: nothing in it outlives a round
        for t in (self.start, self.bonus, self.ctx_feat, self.ctx_n, self.out, self.block_table):
            t[dst] = t[src]
        self.sampling.copy_row(src, dst)


@dataclass
class GrammarBuffers:
    """What a constrained round reads and writes besides the tree: the token masks of every row and
    node [R, T, words] (int32 bits, written by the host before the verify or decode step; column
    0 is a decode step's) and the draft step's candidates, the top K tokens of each drafted
    position [R, D, K] with their log-probabilities, which the host builds the tree from."""
    masks: torch.Tensor          # [R, T, words] int32
    cand_lp: torch.Tensor        # [R, D, K] float32
    cand_idx: torch.Tensor       # [R, D, K] long

    @classmethod
    def allocate(cls, rows: int, nodes: int, words: int, depth: int, k: int,
                 device: torch.device | str) -> "GrammarBuffers":
        return cls(torch.full((rows, nodes, words), -1, dtype=torch.int32, device=device),
                   torch.zeros(rows, depth, k, device=device),
                   torch.zeros(rows, depth, k, dtype=torch.long, device=device))


@dataclass(frozen=True)
class RoundContext:
    """The models, buffers and sizes the round functions (`spec_decode.rounds`) work on, for rows
    0..B-1 of the state (their K/V in the pools' pages their block tables name). The runner builds it once; CUDA graphs capture the round functions over
    these very tensors, so none may be replaced afterwards (frozen; they are written in place)."""
    target: DecoderLM
    drafter: DFlashDrafter | None
    spec: SpecConfig
    state: RoundState
    kv: PagedKVCache
    dkv: PagedKVCache | None         # the drafter's cache (the same pages), when there is a drafter
    capture_layers: tuple[int, ...]  # target layers whose features feed the drafter
    max_num_seqs: int                # rows of the round state: the largest batch bucket

    def batch_bucket(self, B: int) -> int:
        """The batch bucket rows 0..B-1 run at: per-bucket choices (the DDTree budget) follow it,
        so a graph captured for the bucket and its eager fallback make the same choice."""
        return batch_bucket(B, self.max_num_seqs)

    @property
    def page_size(self) -> int:
        return self.kv.page_size


def _store_tree(dst: DraftTree, src: DraftTree, B: int, W: int) -> None:
    dst.tokens[:B, :W] = src.tokens
    dst.parents[:B, :W] = src.parents
    dst.depth[:B, :W] = src.depth
    dst.valid[:B, :W] = src.valid
    dst.visible[:B, :W, :W] = src.visible
