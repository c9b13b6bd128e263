"""The round's per-row buffers, allocated once for `max_num_seqs` rows: the round state (committed
tokens, drafter features, the draft tree, the block table), the constrained round's masks and
candidates, and the processed round's per-row state. One definition serves the runner, which
allocates them on its device, and the memory plan, which counts the same allocation on the meta
device (`round_buffer_bytes`), so a change to any buffer moves both."""
from __future__ import annotations

import dataclasses

import torch

from drafttree.config import ModelConfig
from drafttree.phases import Phase, SpecConfig
from drafttree.sampling import MAX_LOGPROBS
from drafttree.spec_decode.logits import LogitsBuffers
from drafttree.spec_decode.state import GrammarBuffers, RoundState

# Candidates per drafted position a constrained round's draft leaves for the host's tree (at least
# the widest tree's nodes): where the grammar forbids the drafter's best, the next ones stand in.
CANDIDATES = 32


def allocate_round_state(target: ModelConfig, spec: SpecConfig, rows: int, pages_per_row: int, feat: int,
                         dtype: torch.dtype, device: torch.device | str) -> RoundState:
    """`feat`: the drafter's context features per position (0 without a drafter)."""
    # committed tokens: what a verify commits at most; pending drafter features: what one
    # context phase writes; the draft tree: the widest verify of any batch bucket
    state = RoundState.allocate(rows, spec.max_commit, feat, dtype, device, pages_per_row,
                                len(spec.predicted_budgets), spec.verify_width_max if spec.speculative else 0,
                                pending=spec.width(Phase.CONTEXT))
    V = target.vocab_size
    # structured output: token masks per row and node, and the draft step's candidates
    state.grammar = GrammarBuffers.allocate(rows, max(spec.verify_width_max, 1), (V + 31) // 32, spec.depth,
                                            min(V, max(CANDIDATES, spec.verify_width_max - 1)), device)
    # processed rounds: per-row penalties, bias, banned sequences; committed tokens' log-probabilities
    state.logits = LogitsBuffers.allocate(rows, V, spec.max_commit, MAX_LOGPROBS, device)
    return state


def round_buffer_bytes(target: ModelConfig, spec: SpecConfig, context_layers: int, rows: int, pages_per_row: int,
                       dtype: torch.dtype) -> int:
    """Bytes the runner's `allocate_round_state` takes for `rows` rows of block tables
    `pages_per_row` wide (`CacheConfig.pages_per_row`), counted on the meta device.
    `context_layers`: the target layers whose features the drafter reads (0 without one)."""
    feat = context_layers * target.hidden_size
    seen: set[int] = set()

    def walk(x: object) -> int:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return x.numel() * x.element_size()
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return sum(walk(getattr(x, f.name)) for f in dataclasses.fields(x))
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0
    return walk(allocate_round_state(target, spec, rows, pages_per_row, feat, dtype, "meta"))
