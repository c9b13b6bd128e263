"""What one engine step may prefill, and the prefill graphs that cover it: one definition, by
which the scheduler forms its forwards and graphed prefill captures (at start-up) and replays.

A step's prefill is one padded forward over chunks of several requests: at most `max_num_seqs`
chunks (each request takes a row), at most `prefill_chunk` prompt tokens in all, and, with more
than one chunk, chunks x widest at most `max_prefill_tokens` (`fits`). A forward whose chunks
all start at position 0 may replay graphs (`groups`): its width padded to a length bucket Pb (a
power of two, at least MIN_LEN, at most `graph_tokens` and the cache's positions), its chunks in
groups of graph_tokens // Pb, each group's count padded to a row bucket (a power of two, at most
the group's size).

Row buckets bound the captures: at max_num_seqs 256 and the default chunking, one graph per
chunk count would be 255 graphs (128 at 16 tokens, 64 at 32, ..., 1 at 2,048); powers of two
make 36. A padding row reads and writes the null page only, and at most doubles the rows of a
forward that small prefills leave host-bound anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

from drafttree.kernels.triton_jit import next_pow2

MIN_LEN = 16        # the shortest length bucket
MAX_TOKENS = 2048   # padded tokens of one graph at most: a longer forward is GPU-bound, eager
Shape = tuple[int, int]   # (rows, padded length) of one prefill graph


@dataclass(frozen=True)
class Group:
    first: int      # the forward's chunks first .. first + count - 1
    count: int
    shape: Shape    # the graph it replays: shape[0] >= count rows


@dataclass(frozen=True)
class PrefillLimits:
    max_num_seqs: int           # chunks in one forward at most
    prefill_chunk: int          # prompt tokens per step, all chunks together
    max_prefill_tokens: int     # chunks x widest in one forward of several chunks
    max_prompt_len: int         # the longest prefill a request makes (max_model_len - 1)
    max_len: int                # positions a request's block table covers
    max_graph_tokens: int = MAX_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "max_prefill_tokens", "max_prompt_len", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    # -- the scheduler's rule ---------------------------------------------------------------
    def fits(self, n: int, widest: int) -> bool:
        """Whether n chunks, the widest of `widest` tokens, make one forward (one always does)."""
        return n == 1 or n * widest <= self.max_prefill_tokens

    def most_chunks(self, widest: int) -> int:
        """The most chunks a step's forward holds when its widest has `widest` tokens: the others
        have a token at least, all within the step's tokens, the rows and `fits`."""
        n = min(self.max_num_seqs, self.prefill_chunk - widest + 1, self.max_prefill_tokens // widest)
        return max(n, 1)

    # -- the graphs -------------------------------------------------------------------------
    @property
    def graph_tokens(self) -> int:
        return min(self.max_graph_tokens, self.prefill_chunk)

    def length_bucket(self, width: int) -> int | None:
        """The padded length of a graphed forward `width` tokens wide, or None (eager)."""
        Pb = max(MIN_LEN, next_pow2(width))
        return Pb if Pb <= self.graph_tokens and Pb <= self.max_len else None

    def row_bucket(self, count: int, Pb: int) -> int:
        return min(next_pow2(count), self.graph_tokens // Pb)

    def groups(self, n: int, width: int) -> list[Group] | None:
        """The graphs a forward of n chunks starting at 0, `width` tokens wide, replays, group by
        group; None when it runs eagerly."""
        Pb = self.length_bucket(width)
        if Pb is None:
            return None
        g = self.graph_tokens // Pb
        return [Group(a, min(g, n - a), (self.row_bucket(min(g, n - a), Pb), Pb)) for a in range(0, n, g)]

    def shapes(self) -> list[Shape]:
        """Every shape `groups` gives for a forward the scheduler can form, largest first. Within
        a length bucket the narrowest width allows the most chunks, and any fewer chunks too."""
        out: set[Shape] = set()
        Pb = MIN_LEN
        while Pb <= min(self.graph_tokens, self.max_len):
            narrowest = 1 if Pb == MIN_LEN else Pb // 2 + 1
            if narrowest > min(self.max_prompt_len, self.prefill_chunk):
                break
            for n in range(1, self.most_chunks(narrowest) + 1):
                out.update(grp.shape for grp in self.groups(n, narrowest) or ())
            Pb *= 2
        return sorted(out, key=lambda s: (-s[0] * s[1], -s[1]))
