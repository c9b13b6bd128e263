"""What one engine step may prefill, and the prefill graphs that cover it: one definition, by
which the scheduler forms its forwards and graphed prefill captures (at start-up) and replays.

A step's prefill is one padded forward over chunks of several requests: at most `max_num_seqs`
chunks (each request takes a row), at most `prefill_chunk` prompt tokens in all, and, with more
than one chunk, chunks x widest at most `max_prefill_tokens` (`fits`). A forward replays graphs
(`groups`): its width padded to a length bucket Pb (a power of two, at least MIN_LEN, at most
`graph_tokens` and the cache's positions), its chunks in groups of graph_tokens // Pb, each
group's count padded to a row bucket (a power of two, at most the group's size).

A graph's key is (rows, Pb, L). L = 0: every chunk starts at position 0 (no prefix-cache hit, no
continuing chunk) and attention covers the Pb new positions. L > 0: some chunk starts at an
offset (after a prefix-cache hit, or continuing a prompt longer than a step's tokens), and
attention covers the L cache positions of the smallest of the rounds' KV-length buckets
(`kv_buckets`, 1024 * 4^i capped at max_len) that holds the forward's reach, max(start + len) of
its chunks (known on the host). A forward at an offset runs the same groups as one from 0, so the
shapes are the (rows, Pb) set x ({0} and every bucket L >= Pb that a reach can fall in).

Row buckets bound the captures: at max_num_seqs 256 and the default chunking, one graph per
chunk count would be 255 graphs per attention length (128 at 16 tokens, 64 at 32, ..., 1 at
2,048); powers of two make 36. A padding row reads and writes the null page only, and at most
doubles the rows of a forward that small prefills leave host-bound anyway. With the default
model's context (8,192, buckets 1,024, 4,096 and 8,224) the offsets add 35 x 3 + 1 x 2 = 107:
143 graphs in all; a longer context adds 36 per bucket (a context of 40,960: 179). Every
(rows, Pb, L) of these can occur (many requests behind a long shared system prompt reach any
bucket at any chunk count), so none is left out: a shape left out would send its prefills back
to the host-bound eager path, an order of magnitude slower for a small model.
"""
from __future__ import annotations

from dataclasses import dataclass

from drafttree.kernels.triton_jit import next_pow2

MIN_LEN = 16        # the shortest length bucket
MAX_TOKENS = 2048   # padded tokens of one graph at most: a longer forward is GPU-bound, eager
Shape = tuple[int, int, int]   # (rows, padded length Pb, attention length L: 0 = Pb, all from position 0)


def at_offsets(shapes) -> int:
    """How many of these (rows, Pb, L) shapes serve forwards at an offset (L > 0)."""
    return sum(L > 0 for _, _, L in shapes)


def reach(spans: list[tuple[int, int]]) -> int:
    """A forward's reach from its chunks' (start, length): max(start + length) when any chunk
    starts at an offset, 0 when every chunk starts at 0 (its graphs attend over Pb alone)."""
    return max(a + n for a, n in spans) if any(a for a, _ in spans) else 0


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
    kv_buckets: tuple[int, ...]   # the rounds' attention lengths (CacheConfig.kv_buckets), the last max_len
    max_graph_tokens: int = MAX_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "max_prefill_tokens", "max_prompt_len", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        b = self.kv_buckets
        if not b or list(b) != sorted(set(b)) or b[-1] != self.max_len:
            raise ValueError(f"kv_buckets must rise to max_len {self.max_len}, got {b}")

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

    def attn_len(self, reach: int) -> int:
        """L of a forward whose chunks end by position `reach` (max(start + len)), or 0 when
        every chunk starts at 0 (`reach` 0). L >= Pb: reach >= width, and a bucket below Pb
        would be max_len, which no graphed Pb passes."""
        if reach <= 0:
            return 0
        if reach > self.max_len:
            raise ValueError(f"a prefill reaching position {reach} past the cache's {self.max_len}")
        return next(L for L in self.kv_buckets if L >= reach)

    def groups(self, n: int, width: int, reach: int = 0) -> list[Group] | None:
        """The graphs a forward of n chunks, `width` tokens wide, replays, group by group; None
        when it runs eagerly. `reach`: max(start + len) of its chunks when any starts at an
        offset, 0 when all start at 0."""
        Pb = self.length_bucket(width)
        if Pb is None:
            return None
        L, g = self.attn_len(reach), self.graph_tokens // Pb
        return [Group(a, min(g, n - a), (self.row_bucket(min(g, n - a), Pb), Pb, L)) for a in range(0, n, g)]

    def offset_lengths(self) -> list[int]:
        """The buckets a forward at an offset can attend over: those a reach of at most
        max_prompt_len falls in (the bucket below holds less)."""
        b = self.kv_buckets
        return [L for i, L in enumerate(b) if i == 0 or b[i - 1] < self.max_prompt_len]

    def shapes(self) -> list[Shape]:
        """Every shape `groups` gives for a forward the scheduler can form, the largest (rows x
        padded tokens, then attention length) first. Within a length bucket the narrowest width
        allows the most chunks, and any fewer chunks too; a forward at an offset forms the same
        groups at any bucket that holds its width."""
        base: set[tuple[int, int]] = set()
        Pb = MIN_LEN
        while Pb <= min(self.graph_tokens, self.max_len):
            narrowest = 1 if Pb == MIN_LEN else Pb // 2 + 1
            if narrowest > min(self.max_prompt_len, self.prefill_chunk):
                break
            for n in range(1, self.most_chunks(narrowest) + 1):
                base.update(grp.shape[:2] for grp in self.groups(n, narrowest) or ())
            Pb *= 2
        Ls = self.offset_lengths()
        out = [(n, Pb, L) for n, Pb in base for L in [0] + [L for L in Ls if L >= Pb]]
        return sorted(out, key=lambda s: (-s[0] * s[1], -(s[2] or s[1]), -s[1]))
