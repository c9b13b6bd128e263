"""Constrained rounds (structured output) on the engine's side: a request's grammar checked when it
is added and its matcher built on a grammar thread (the request queues once it is), its first
token's mask at prefill, the constrained round's launch (a masked decode step, or a draft whose
candidates the host reads, the trees of the rows that follow a grammar grown along each path's
grammar state, then the masked verify, in which the other rows verify the draft's own trees) and
the matchers advanced over committed tokens.

A constrained round is read before the next one launches (its trees need the tokens it commits),
so batches holding a constrained request do not overlap their rounds; others keep overlapping.
What the next round needs from the device alone, its draft, is queued right behind a drafting
round (`draft_ahead`), so the device drafts while the host reads, emits and advances the matchers;
the next launch takes those candidates if its rows are the same and no prefill ran between, else
drafts again (a draft only rewrites the drafter's context slots with the same values, and scratch
past each row's end).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from drafttree.engine.sequence import Sequence
from drafttree.phases import Phase
from drafttree.runner.model_runner import ModelRunner, PrefillChunk
from drafttree.sampling import SampleMode
from drafttree.structured.grammar import ALL_ALLOWED, GrammarCompiler, Thought
from drafttree.structured.reasoning import Reasoning
from drafttree.structured.tree import build_trees

log = logging.getLogger(__name__)

BUILD_THREADS = 2   # matchers built at once (llguidance releases Python's lock while it builds)


@dataclass
class ConstrainedTimes:
    """Host seconds of the constrained rounds since the last reset: waiting for the draft's
    candidates (the round's one sync), growing the trees with their masks, and the masks of
    decode steps and first tokens."""
    rounds: int = 0
    candidates_wait_s: float = 0.0
    tree_build_s: float = 0.0
    decode_masks_s: float = 0.0
    tree_nodes: int = 0           # nodes grown (roots excluded)
    thought_trees: int = 0        # of the trees, those grown inside a reasoning the constraint leaves free
    drafted_ahead: int = 0        # rounds whose draft was queued behind the previous round


class Constrained:
    """One engine's grammars and its constrained rounds."""

    def __init__(self, runner: ModelRunner, tokenizer, vocab: int, eos_ids: set[int],
                 reasoning: Reasoning | None = None) -> None:
        self.runner, self.tokenizer, self.vocab, self.eos_ids = runner, tokenizer, vocab, set(eos_ids)
        self.reasoning = reasoning   # a reasoning model's constraints hold from the end of its reasoning
        self._compiler: GrammarCompiler | None = None
        self._builder: ThreadPoolExecutor | None = None   # the grammar threads, from the first constraint
        self.times = ConstrainedTimes()
        self.ahead: _Rows | None = None   # the rows, mode and processing of the draft queued ahead

    @property
    def compiler(self) -> GrammarCompiler:
        """Built at the first constrained request (reading the vocabulary takes up to a second)."""
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model has none")
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab, self.eos_ids)
        return self._compiler

    def attach(self, seq: Sequence) -> bool:
        """Check the request's constraint (ValueError naming what is wrong, before it runs) and
        start building its matcher on a grammar thread (`seq.grammar_build`; `built` takes it):
        a large schema's parser takes milliseconds, which the engine's rounds need not wait for.
        False where the request has no constraint."""
        so = seq.params.structured_outputs
        if so is None:
            return False
        if self.reasoning is not None and so.after_reasoning is None:
            so = replace(so, after_reasoning=self.reasoning.constraint(self.reasoning.state(seq.prompt_ids)))
        text = self.compiler.compile(so)   # checked here, cached by the constraint
        if self._builder is None:
            self._builder = ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="grammar")
        seq.grammar_build = self._builder.submit(self.compiler.build, text, so.after_reasoning)
        return True

    def built(self, seq: Sequence, wait: bool = False) -> bool:
        """Whether seq's matcher is built (then it is seq.grammar); `wait`: until it is. Raises
        what the build raised."""
        f = seq.grammar_build
        if f is None:
            return True
        if not (wait or f.done()):
            return False
        seq.grammar, seq.grammar_build = f.result(), None
        return True

    def first_masks(self, chunks: list[tuple[Sequence, PrefillChunk]]) -> None:
        """The first-token mask of each chunk that ends a constrained request's prefill."""
        for seq, c in chunks:
            if seq.grammar is not None and c.row >= 0 and c.bonus is None:
                c.mask = self.masks([seq])[0]

    def masks(self, seqs: list[Sequence]) -> np.ndarray:
        """[len(seqs), words]: each constrained request's mask at its current state; the others all allowed."""
        t0 = time.perf_counter()
        out = np.full((len(seqs), self.compiler.words), ALL_ALLOWED, dtype=np.int32)
        self.compiler.fill_masks([(s.grammar, i) for i, s in enumerate(seqs) if s.grammar is not None], out)
        self.times.decode_masks_s += time.perf_counter() - t0
        return out

    def launch(self, running: list[Sequence], mode: SampleMode, max_length: int, budget: int,
               processed: bool = False) -> float:
        """Run a constrained round over rows 0..B-1 (`running`) at `budget` (0: a masked decode step);
        `processed`: a processed round (`ModelRunner.run_round`). Returns the host seconds spent
        between its draft and its verify (growing the trees with their masks)."""
        r, B = self.runner, len(running)
        spec = r.spec
        t0 = time.perf_counter()
        host_s = 0.0
        ahead, self.ahead = self.ahead, None
        if budget == 0:
            r.run_masked_decode(B, mode, max_length, self.masks(running), processed=processed)
        else:
            if ahead is None or not ahead.same(running, mode, processed):
                r.run_candidates(B, mode, max_length, processed=processed)
            else:
                self.times.drafted_ahead += 1
            lp, idx = r.candidates(B)
            t1 = time.perf_counter()
            bucket = r.cache_cfg.batch_bucket(B)
            width = spec.width(Phase.VERIFY, bucket, budget)
            matchers = [None if s.grammar is None else s.grammar.thought() or s.grammar for s in running]
            trees = build_trees(lp, idx, [s.output_ids[-1] for s in running], width, r.state.tree.num_nodes, matchers,
                                spec.method == "dflash", self.compiler, self.eos_ids,
                                r.mask_stage(width * sum(m is not None for m in matchers)))
            t2 = time.perf_counter()
            r.run_masked_verify(B, mode, max_length, budget, trees, processed=processed)
            self.times.candidates_wait_s += t1 - t0
            self.times.tree_build_s += t2 - t1
            host_s = t2 - t1
            self.times.tree_nodes += int(trees.valid[:, 1:].sum())
            self.times.thought_trees += sum(isinstance(m, Thought) for m in matchers)
        self.times.rounds += 1
        return host_s

    def draft_ahead(self, running: list[Sequence], mode: SampleMode, max_length: int, processed: bool) -> None:
        """Queue the next round's draft behind the round just launched (and its outputs' copy):
        `max_length` bounds the rows' committed lengths after it. The next `launch` over the same
        rows takes its candidates."""
        self.runner.run_candidates(len(running), mode, max_length, processed=processed)
        self.ahead = _Rows(list(running), [s.row for s in running], mode, processed)

    def drop_ahead(self) -> None:
        """Forget the draft queued ahead: its rows' state is being written anew."""
        self.ahead = None

    def advance(self, seq: Sequence, kept: list[int]) -> None:
        """Move the request's matcher over the tokens it committed; a grammar that is complete ends
        the request where the model has no end-of-sequence token to emit."""
        m = seq.grammar
        if m is None or not kept:
            return
        took = m.advance(kept)
        if took < len(kept):
            # The masks allow only what the grammar takes, so this is either the request's own
            # token filters leaving the grammar no token at all (every logit -inf), or a defect.
            p = seq.params
            filters = [name for name, on in (("allowed_token_ids", p.allowed_token_ids), ("bad_words", p.bad_words),
                                             ("logit_bias", p.logit_bias)) if on]
            log.error("request %s: the grammar refused token %d of the committed ones (%s)%s", seq.request_id,
                      kept[took], m.error, f"; its {' and '.join(filters)} may leave the grammar no token"
                      if filters else "")
            seq.finish("abort")
        elif m.stopped and not self.eos_ids:
            seq.finish("stop")

    def reset(self) -> None:
        self.times = ConstrainedTimes()


@dataclass
class _Rows:
    """The requests a draft ran over (held, so that no other can be taken for one of them), their
    rows, its sampler mode and processing."""
    seqs: list[Sequence]
    rows: list[int]
    mode: SampleMode
    processed: bool

    def same(self, running: list[Sequence], mode: SampleMode, processed: bool) -> bool:
        return (mode is self.mode and processed == self.processed and len(running) == len(self.seqs)
                and all(a is b and a.row == r for a, b, r in zip(running, self.seqs, self.rows)))
