"""The phase table: every forward a round can run, with its function, its width and the static
buffers it reads and writes.

The runner's eager rounds, the CUDA graphs (one per step), the cost model and `bench.phases` all
take their steps from here: a step's function, its width (`SpecConfig.width`) and its buffers are
written once. A round is a decode step, or a draft (at the batch bucket's largest budget: its tree
is stored in the round state) and a verify of that tree's first budget + 1 nodes; either after a
context phase where a drafter's pending features could fill their buffer, or more wait than the
draft writes (after plain rounds).

A constrained round (a batch with a structured-output request) has steps of its own: a decode
step whose pick is masked, a draft step that leaves the drafter's candidates instead of a tree
(the host grows the tree along each path's grammar state) and a verify whose picks are masked
node by node; the masks, the tree and the candidates are static buffers (`GrammarBuffers`).

A processed round (a batch with a request that asks for log-probabilities or logits processing:
penalties, logit_bias, banned tokens, min_tokens, min_p) runs processed decode and verify steps
(`spec_decode.logits`, over `LogitsBuffers`), constrained or not; its context and draft steps are
the plain ones. A processed round picks greedily or in the filtered mode (`processed_mode`), so
its graphs are captured in those two modes only.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from drafttree.phases import Phase, SpecConfig
from drafttree.sampling import SampleMode
from drafttree.spec_decode.rounds import candidates_phase, context_phase, decode_round, draft_phase, verify_phase
from drafttree.spec_decode.state import RoundContext

# Unfiltered sampling (top-p 1, the API default) has its own graphs: the filtered ones would give
# the same tokens but find every row's top-k / top-p threshold each round.
CAPTURED_MODES = (SampleMode.GREEDY, SampleMode.SAMPLE, SampleMode.FILTERED)

Run = Callable[[RoundContext, int, int, SampleMode, int], object]

# phase -> (function of (round context, rows B, KV length, sampler mode, budget), state buffers it
# reads or writes beyond the KV pools)
TABLE: dict[Phase, tuple[Run, tuple[str, ...]]] = {
    Phase.CONTEXT: (lambda rc, B, L, mode, n: context_phase(rc, B), ("pending features",)),
    Phase.DECODE: (lambda rc, B, L, mode, n: decode_round(rc, B, L, mode),
                   ("pending features", "committed tokens", "block table")),
    Phase.DRAFT: (lambda rc, B, L, mode, n: draft_phase(rc, B, L),
                  ("pending features", "draft tree", "predictions", "block table")),
    Phase.VERIFY: (lambda rc, B, L, mode, n: verify_phase(rc, B, L, mode, n),
                   ("draft tree", "pending features", "committed tokens", "observed acceptance", "block table")),
}

# phases that pick no token (one graph serves every sampler mode), and those that attend over
# nothing (they write K/V only: one graph serves every KV length)
MODELESS = (Phase.CONTEXT, Phase.DRAFT)
LENGTHLESS = (Phase.CONTEXT,)

# the constrained round's steps (phase -> as TABLE)
CONSTRAINED: dict[Phase, tuple[Run, tuple[str, ...]]] = {
    Phase.CONTEXT: TABLE[Phase.CONTEXT],
    Phase.DECODE: (lambda rc, B, L, mode, n: decode_round(rc, B, L, mode, masked=True),
                   ("pending features", "committed tokens", "block table", "token masks")),
    Phase.DRAFT: (lambda rc, B, L, mode, n: candidates_phase(rc, B, L),
                  ("pending features", "draft tree", "draft candidates", "predictions", "block table")),
    Phase.VERIFY: (lambda rc, B, L, mode, n: verify_phase(rc, B, L, mode, n, masked=True),
                   ("draft tree", "token masks", "pending features", "committed tokens", "observed acceptance",
                    "block table")),
}


def _processed(table: dict[Phase, tuple[Run, tuple[str, ...]]], masked: bool) -> dict[Phase, tuple[Run, tuple[str, ...]]]:
    """`table` with processed decode and verify steps (its context and draft steps as they are)."""
    return {**table,
            Phase.DECODE: (lambda rc, B, L, mode, n: decode_round(rc, B, L, mode, masked, processed=True),
                           table[Phase.DECODE][1] + ("logits state",)),
            Phase.VERIFY: (lambda rc, B, L, mode, n: verify_phase(rc, B, L, mode, n, masked, processed=True),
                           table[Phase.VERIFY][1] + ("logits state",))}


# (constrained, processed) -> the steps of such a round
TABLES = {(False, False): TABLE, (True, False): CONSTRAINED,
          (False, True): _processed(TABLE, False), (True, True): _processed(CONSTRAINED, True)}
# the sampler modes a processed round picks in (`processed_mode`): its graphs are captured in these
PROCESSED_MODES = (SampleMode.GREEDY, SampleMode.FILTERED)


def processed_mode(mode: SampleMode) -> SampleMode:
    """The mode a processed round picks in: greedy, else filtered (which also serves rows without
    top-k / top-p), so that its graphs are captured in two modes, not three."""
    return mode if mode is SampleMode.GREEDY else SampleMode.FILTERED


@dataclass(frozen=True)
class PhaseStep:
    phase: Phase
    budget: int      # the verify's budget; 0 for the other phases
    width: int       # tokens per request in its forward: spec.width(phase, bucket, budget)
    constrained: bool = False   # a constrained round's step (masked picks; the draft leaves candidates)
    processed: bool = False     # a processed round's decode or verify (logits processing, log-probabilities)

    def run(self, rc: RoundContext, B: int, kv_len: int, mode: SampleMode) -> None:
        """This step over rows 0..B-1, attending over kv_len cache slots."""
        TABLES[self.constrained, self.processed][self.phase][0](rc, B, kv_len, mode, self.budget)

    @property
    def buffers(self) -> tuple[str, ...]:
        return TABLES[self.constrained, self.processed][self.phase][1]

    @property
    def picks(self) -> bool:
        """Picks tokens: its graphs differ by sampler mode."""
        return self.phase not in MODELESS

    @property
    def attends(self) -> bool:
        """Attends over the cache: its graphs differ by KV length."""
        return self.phase not in LENGTHLESS


def step(spec: SpecConfig, phase: Phase, bucket: int, budget: int = 0, constrained: bool = False,
         processed: bool = False) -> PhaseStep:
    """The step of `phase` over a batch bucket (a verify at `budget`), its width from the spec."""
    b = budget if phase is Phase.VERIFY else 0
    return PhaseStep(phase, b, spec.width(phase, bucket, b if phase is Phase.VERIFY else None),
                     constrained and phase is not Phase.CONTEXT,
                     processed and phase in (Phase.DECODE, Phase.VERIFY))


def bucket_steps(spec: SpecConfig, bucket: int, mode: SampleMode, drafter: bool,
                 constrained: bool = False, processed: bool = False) -> tuple[PhaseStep, ...]:
    """Every step a round over the batch bucket in `mode` may run, in the order a round runs them:
    the context phase (with a drafter), the decode step, then the draft and a verify per budget
    the bucket may verify at in this mode; with `constrained`, the constrained round's decode,
    draft and verifies after them; with `processed`, the processed decode and verifies (of both
    kinds of round, with `constrained`) after those."""
    out = [step(spec, Phase.CONTEXT, bucket)] if drafter else []
    budgets = [n for n in spec.budgets_at(bucket, mode is SampleMode.GREEDY) if n]
    kinds = (False, True) if constrained else (False,)
    for c in kinds:
        out.append(step(spec, Phase.DECODE, bucket, constrained=c))
        if budgets:
            out.append(step(spec, Phase.DRAFT, bucket, constrained=c))
            out += [step(spec, Phase.VERIFY, bucket, n, constrained=c) for n in budgets]
    for c in kinds if processed else ():
        out.append(step(spec, Phase.DECODE, bucket, constrained=c, processed=True))
        out += [step(spec, Phase.VERIFY, bucket, n, constrained=c, processed=True) for n in budgets]
    return tuple(out)


def round_steps(spec: SpecConfig, bucket: int, budget: int, context: bool, constrained: bool = False,
                processed: bool = False) -> tuple[PhaseStep, ...]:
    """The steps of one round over the batch bucket at `budget` (0: a decode step; else a draft and
    a verify), after a context phase when `context`; the budget must be one the bucket may verify
    at. `constrained`: the constrained round's steps (its draft and verify run apart: the host
    builds the tree between). `processed`: a processed round's."""
    c, p = constrained, processed
    first = (step(spec, Phase.CONTEXT, bucket),) if context else ()
    if budget == 0:
        return first + (step(spec, Phase.DECODE, bucket, constrained=c, processed=p),)
    return first + (step(spec, Phase.DRAFT, bucket, constrained=c),
                    step(spec, Phase.VERIFY, bucket, budget, constrained=c, processed=p))


def buffer_widths(rc: RoundContext, bucket: int, pages_per_row: int) -> dict[str, tuple[int, int]]:
    """(have, want) per static buffer of the round state, want from the spec: pending drafter
    features and committed tokens per row, the block table's pages (max_model_len plus the widest
    round's writes: `pages_per_row`), the draft tree (the widest verify of any bucket) and the
    acceptance model's predictions (one per predicted budget). Host-known shapes: no sync."""
    s, spec = rc.state, rc.spec
    out = {"pending features": (s.ctx_feat.shape[1], spec.width(Phase.CONTEXT, bucket)),
           "committed tokens": (s.out_tokens.shape[1], spec.max_commit),
           "observed acceptance": (s.out_seen.shape[1], len(spec.predicted_budgets)),
           "block table": (s.block_table.shape[1], pages_per_row),
           "predictions": (s.out_pred.shape[1], len(spec.predicted_budgets))}
    if spec.speculative:
        have = s.tree.num_nodes if s.tree is not None else 0
        out["draft tree"] = (have, spec.verify_width_max)
    g = s.grammar
    if g is not None:
        out["token masks"] = (g.masks.shape[1], max(spec.verify_width_max, 1))
        if spec.speculative:
            out["draft candidates"] = (g.cand_idx.shape[1], spec.depth)
    if s.logits is not None:
        out["logits state"] = (s.logits.lp.shape[1], spec.max_commit)
    return out


def check_widths(rc: RoundContext, steps: tuple[PhaseStep, ...], bucket: int, pages_per_row: int) -> None:
    """The buffers `steps` read and write have the widths the spec gives, and a verify's tree
    fits the tree buffer."""
    widths = buffer_widths(rc, bucket, pages_per_row)
    used = {name for st in steps for name in st.buffers}
    bad = {k: v for k, v in widths.items() if k in used and v[0] != v[1]}
    assert not bad, f"batch bucket {bucket}: buffer widths (have, want) {bad}"
    tree = widths.get("draft tree", (0, 0))[0]
    wide = [st.width for st in steps if st.phase is Phase.VERIFY and st.width > tree]
    assert not wide, f"batch bucket {bucket}: a verify of {max(wide, default=0)} nodes, tree buffers of {tree}"
