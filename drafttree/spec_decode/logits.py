"""Logits processing and log-probabilities on the device, per draft position along each tree path.

The target's distribution at tree node i predicts the token after node i, so what is "already
generated" for it is the request's output so far (the bonus token, the tree's root, included)
and the draft tokens on the path from the root to i. A row's output is kept in static buffers
(token counts, the last tokens, the length), updated at commit; a node adds its path's tokens,
read from the tree's ancestor mask. The pick at node i then sees the logits plain decoding sees
when it reaches the same output, so processed rounds stay lossless.

Order, as vLLM's sampler: the bias (logit_bias, -inf for tokens allowed_token_ids leaves out and
for one-token bad words), banned tokens (a multi-token bad word's last token where its other
tokens end the path's output; end-of-sequence and stop_token_ids while the output is shorter
than min_tokens), the penalties (repetition over prompt and output, then frequency and
presence over the output), then min_p on the tempered distribution (top-k / top-p follow in the
pick). Every step is elementwise or an exact reduction, eager (not compiled: a fused multiply-add
would round a node's value otherwise than the decode step rounds it).

Log-probabilities are the target's own (vLLM's default `raw_logprobs`: before any processing
and before temperature), computed for the committed positions only, after the acceptance walk:
the committed token's, its rank, and the engine's K most likely tokens'. The normalizer is summed
in float64 and rounded once, so the reduction order (which kernels choose by shape) does not
show in the float32 result unless the sum falls within float64's rounding of an float32
boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Banned-sequence entries per row (multi-token bad words and min_tokens' stop tokens) and the
# longest banned sequence, in tokens: the table's static shape. A request needing more is refused.
WORDS = 64
WORD_LEN = 16
ANY = -2                 # a prefix slot past a shorter sequence's start: matches any token
UNUSED = -1              # an entry's banned token when it holds none
NEVER = 1 << 62          # an entry that bans for good (not only below min_tokens)


@dataclass
class RowLogits:
    """What one request's row needs for its logits processing (host values, from its
    SamplingParams and the tokenizer): written into the row when its prefill ends."""
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    min_p: float = 0.0
    bias: dict[int, float] = field(default_factory=dict)
    allowed: list[int] | None = None
    banned: list[int] = field(default_factory=list)       # one-token bad words
    words: list[list[int]] = field(default_factory=list)  # multi-token bad words
    stops: list[int] = field(default_factory=list)        # banned while the output is below min_tokens
    min_tokens: int = 0
    prompt: list[int] = field(default_factory=list)       # for the repetition penalty (else empty)
    output: list[int] = field(default_factory=list)       # tokens generated before (a recomputed request)


@dataclass
class LogitsBuffers:
    """Per-row state of processed rounds, and what they return: rows [R], vocabulary V, commit C
    (tokens a round commits per row), K (log-probabilities per token besides the committed one's)."""
    counts: torch.Tensor       # [R, V] int32: each token's count in the output (bonus included)
    prompt: torch.Tensor       # [R, V] bool: tokens of the prompt (repetition penalty)
    bias: torch.Tensor         # [R, V] float32: logit_bias; -inf where never allowed
    knobs: torch.Tensor        # [R, 4] float32: repetition, frequency, presence, min_p
    out_len: torch.Tensor      # [R] long: output tokens so far (bonus included)
    tail: torch.Tensor         # [R, M] long: the output's last M = WORD_LEN - 1 tokens, most recent last; -1 before it
    words: torch.Tensor        # [R, E, M] long: entry e's prefix, j = 0 the token just before the banned
                               # one; ANY past its start
    word_last: torch.Tensor    # [R, E] long: the token entry e bans; UNUSED
    word_until: torch.Tensor   # [R, E] long: e bans while out_len + depth < until (NEVER: always)
    lp: torch.Tensor           # [R, C, 1 + K] float32: each committed token's log-probability, then the top K's
    lp_ids: torch.Tensor       # [R, C, 1 + K] long: the committed token's rank (1: the most likely), then
                               # the top K's ids

    @classmethod
    def allocate(cls, rows: int, vocab: int, commit: int, k: int, device: torch.device | str) -> "LogitsBuffers":
        M = WORD_LEN - 1
        lb = cls(torch.zeros(rows, vocab, dtype=torch.int32, device=device),
                 torch.zeros(rows, vocab, dtype=torch.bool, device=device),
                 torch.zeros(rows, vocab, device=device), torch.zeros(rows, 4, device=device),
                 torch.zeros(rows, dtype=torch.long, device=device),
                 torch.full((rows, M), -1, dtype=torch.long, device=device),
                 torch.full((rows, WORDS, M), ANY, dtype=torch.long, device=device),
                 torch.full((rows, WORDS), UNUSED, dtype=torch.long, device=device),
                 torch.zeros(rows, WORDS, dtype=torch.long, device=device),
                 torch.zeros(rows, commit, 1 + k, device=device),
                 torch.zeros(rows, commit, 1 + k, dtype=torch.long, device=device))
        lb.knobs[:, 0] = 1.0
        return lb

    @property
    def k(self) -> int:
        return self.lp.shape[2] - 1

    def rows(self, sel: slice | torch.Tensor) -> "LogitsBuffers":
        """The buffers of some rows: views for a slice (rounds write through them), copies for an
        index tensor."""
        return LogitsBuffers(*(getattr(self, f)[sel] for f in _FIELDS))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in _FIELDS]

    def copy_row(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def reset_row(self, row: int) -> None:
        """Row `row` processes nothing: no bias, neutral penalties, no banned sequence."""
        self.bias[row].zero_()
        self.knobs[row] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        self.word_last[row].fill_(UNUSED)

    def write_row(self, row: int, r: RowLogits) -> None:
        """Row `row` takes request r's processing, its output so far counted."""
        V, M = self.counts.shape[1], self.tail.shape[1]
        dev = self.counts.device
        counts = torch.zeros(V, dtype=torch.int32)
        if r.output:
            counts.index_add_(0, torch.tensor(r.output), torch.ones(len(r.output), dtype=torch.int32))
        prompt = torch.zeros(V, dtype=torch.bool)
        prompt[r.prompt] = True
        bias = torch.full((V,), float("-inf")) if r.allowed is not None else torch.zeros(V)
        if r.allowed is not None:
            bias[r.allowed] = 0.0
        bias[r.banned] = float("-inf")
        for t, b in r.bias.items():
            bias[t] += b
        tail = torch.full((M,), -1, dtype=torch.long)
        last = r.output[-M:]
        if last:
            tail[M - len(last):] = torch.tensor(last)
        words = torch.full((WORDS, M), ANY, dtype=torch.long)
        word_last = torch.full((WORDS,), UNUSED, dtype=torch.long)
        until = torch.zeros(WORDS, dtype=torch.long)
        entries = [(w, NEVER) for w in r.words] + [([s], r.min_tokens) for s in r.stops]
        assert len(entries) <= WORDS and all(len(w) <= WORD_LEN for w, _ in entries), "checked when added"
        for e, (w, limit) in enumerate(entries):
            words[e, :len(w) - 1] = torch.tensor(w[-2::-1] if len(w) > 1 else [], dtype=torch.long)
            word_last[e], until[e] = w[-1], limit
        for dst, src in ((self.counts, counts), (self.prompt, prompt), (self.bias, bias), (self.tail, tail),
                         (self.words, words), (self.word_last, word_last), (self.word_until, until),
                         (self.knobs, torch.tensor([r.repetition, r.frequency, r.presence, r.min_p]))):
            dst[row].copy_(src.to(dev))
        self.out_len[row] = len(r.output)


_FIELDS = ("counts", "prompt", "bias", "knobs", "out_len", "tail", "words", "word_last", "word_until", "lp", "lp_ids")


def process_logits(x: torch.Tensor, lb: LogitsBuffers, tokens: torch.Tensor, parents: torch.Tensor,
                   depth: torch.Tensor, visible: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """The logits x [B, W, V] (float32) of B rows' trees (tokens, parents, depth [B, W], visible
    [B, W, W]; a decode step's is its root alone) as processed for the picks at every node; lb:
    the B rows' buffers, temp [B] their temperatures. A new tensor."""
    x = x + lb.bias[:, None, :]
    x = _ban(x, lb, tokens, parents, depth)
    x = _penalize(x, lb, tokens, depth, visible)
    return _min_p(x, lb.knobs[:, 3], temp)


def _ban(x: torch.Tensor, lb: LogitsBuffers, tokens: torch.Tensor, parents: torch.Tensor,
         depth: torch.Tensor) -> torch.Tensor:
    """-inf at each entry's banned token where the entry is active and its prefix ends the output
    that node i's path gives (k-th most recent token: node i's k-th ancestor while it is below
    the root, else the row's output tail)."""
    B, W, V = x.shape
    M, E = lb.tail.shape[1], lb.word_last.shape[1]
    node = torch.arange(W, device=x.device).expand(B, W)
    hist = []
    for k in range(M):
        from_tail = lb.tail.gather(1, (M - 1 - k + depth).clamp(max=M - 1))
        hist.append(torch.where(depth > k, tokens.gather(1, node), from_tail))
        node = parents.gather(1, node)
    hist = torch.stack(hist, -1)                                                   # [B, W, M]
    match = ((hist[:, :, None, :] == lb.words[:, None]) | (lb.words == ANY)[:, None]).all(-1)   # [B, W, E]
    active = (lb.word_last >= 0)[:, None, :] & ((lb.out_len[:, None] + depth)[:, :, None] < lb.word_until[:, None, :])
    banned = torch.where(match & active, float("-inf"), float("inf"))
    # min over duplicate targets: the same result in any order
    return x.scatter_reduce_(2, lb.word_last.clamp(min=0)[:, None, :].expand(B, W, E), banned, "amin")


def _penalties(x: torch.Tensor, count: torch.Tensor, seen: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties, elementwise: repetition divides a positive logit (multiplies a negative one)
    of a token seen in the prompt or output; frequency subtracts per occurrence in the output,
    presence once. Neutral knobs (1, 0, 0) give x exactly."""
    rep, freq, pres = (knobs[:, i].view(-1, 1, 1) for i in range(3))
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * count
    return x - pres * (count > 0).float()


def _penalize(x: torch.Tensor, lb: LogitsBuffers, tokens: torch.Tensor, depth: torch.Tensor,
              visible: torch.Tensor) -> torch.Tensor:
    """The penalties at every node: the row's counts for every token, then, at the tokens of the
    tree, the counts its nodes' paths add (node i's ancestors below the root, i included)."""
    B, W, _ = x.shape
    count = lb.counts.float()[:, None, :]
    out = _penalties(x, count, lb.prompt[:, None, :] | (count > 0), lb.knobs)
    on_path = (visible & (depth > 0)[:, None, :]).double()                         # [B, i, j]
    same = (tokens[:, :, None] == tokens[:, None, :]).double()                    # [B, j', j]
    extra = torch.bmm(on_path, same).float()            # [B, i, j]: i's path holds j's token this often (exact)
    cols = tokens[:, None, :].expand(B, W, W)
    count = lb.counts.gather(1, tokens).float()[:, None, :] + extra
    seen = lb.prompt.gather(1, tokens)[:, None, :] | (count > 0)
    at_path = _penalties(x.gather(2, cols), count, seen, lb.knobs)
    # a value per (node, token): columns with the same token write the same value
    return out.scatter_(2, cols, torch.where(extra > 0, at_path, out.gather(2, cols)))


def _min_p(x: torch.Tensor, min_p: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """min_p over the tempered distribution: tokens whose probability is below min_p times the
    largest are dropped (a row at min_p 0 keeps all; at T = 0 the argmax is always kept)."""
    scaled = x / torch.where(temp > 0, temp, 1.0)[:, None, None]
    thr = scaled.amax(-1, keepdim=True) + torch.log(min_p)[:, None, None]
    return x.masked_fill(scaled < thr, float("-inf"))


def commit_output(lb: LogitsBuffers, tokens: torch.Tensor, tau: torch.Tensor) -> None:
    """The B rows' output grows by the first tau[b] of tokens [B, C]: counts, tail and length."""
    B, C = tokens.shape
    M = lb.tail.shape[1]
    keep = (torch.arange(C, device=tokens.device)[None, :] < tau[:, None]).int()
    lb.counts.scatter_add_(1, tokens, keep)
    both = torch.cat([lb.tail, tokens], 1)
    lb.tail.copy_(both.gather(1, torch.arange(M, device=tokens.device)[None, :] + tau[:, None]))
    lb.out_len += tau


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, N, V] (raw), tokens [B, N] -> ([B, N, 1 + k] float32: each token's log-probability
    then the k most likely ones', [B, N, 1 + k] long: the token's rank, then those k ids; past a
    vocabulary smaller than k, id -1 at -inf)."""
    x = logits.float()
    top, ids = x.topk(min(k, x.shape[-1]), dim=-1)
    if k > x.shape[-1]:
        pad = k - x.shape[-1]
        top = torch.cat([top, top.new_full((*top.shape[:-1], pad), float("-inf"))], -1)
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], pad), -1)], -1)
    m = x.amax(-1, keepdim=True)
    lse = (x.double() - m.double()).exp().sum(-1, keepdim=True).log() + m.double()
    tok = x.gather(2, tokens[..., None])
    rank = (x > tok).sum(-1, keepdim=True) + 1
    return (torch.cat([tok, top], -1).double() - lse).float(), torch.cat([rank, ids], -1)


def path_logprobs(lb: LogitsBuffers, logits: torch.Tensor, path: torch.Tensor, tokens: torch.Tensor) -> None:
    """The committed tokens' log-probabilities into lb.lp / lb.lp_ids (B rows): tokens [B, C] are
    the picks at tree nodes path [B, C] of logits [B, W, V]."""
    B, C = path.shape
    V = logits.shape[2]
    lp, ids = token_logprobs(logits.gather(1, path[..., None].expand(B, C, V)), tokens, lb.k)
    lb.lp[:, :C].copy_(lp)
    lb.lp_ids[:, :C].copy_(ids)


def ban_limits_message(words: int, longest: int) -> str | None:
    """Why a request's banned sequences do not fit the table (None: they fit)."""
    if words > WORDS:
        return f"{words} banned sequences (bad_words' token sequences, and with min_tokens the stop tokens); " \
               f"a request may have {WORDS}"
    if longest > WORD_LEN:
        return f"a bad word of {longest} tokens; a bad word may have at most {WORD_LEN}"
    return None

