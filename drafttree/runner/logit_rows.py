"""The prefill's side of processed requests (`spec_decode.logits`): each row's processing state
written when a request takes the row, its first token processed as any decode step's pick, and
the log-probabilities the prefill gives (the first token's, and the prompt's from the prefill's
hidden states, the LM head run over them only where a request asks)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafttree.models.decoder import DecoderLM
from drafttree.spec_decode.logits import LogitsBuffers, RowLogits, commit_output, process_logits, token_logprobs

# Prompt positions per LM head forward for prompt log-probabilities: bounds the float32 logits and
# their float64 normalizer ([n, V] each) whatever the chunk's length.
PROMPT_SLICE = 256


@dataclass(frozen=True)
class PromptAsk:
    """A chunk's prompt log-probabilities: of the tokens after positions first .. first + n - 1 (all
    inside the chunk), `next_ids` (n of them), each with the k most likely tokens'."""
    first: int
    next_ids: list[int]
    k: int


# token log-probabilities of one position: ([logprob, then the k most likely's], [rank, then their ids])
Logprobs = tuple[list[float], list[int]]


@dataclass
class PrefillLogprobs:
    """What a prefill forward gave besides its tokens, by chunk index."""
    first: dict[int, Logprobs] = field(default_factory=dict)           # the first token's, where asked
    prompt: dict[int, list[Logprobs]] = field(default_factory=dict)    # per asked position, in order


class LogitRows:
    """Which rows of the round state hold a request's processing state (host-side, no sync): a row
    that never held one is neutral and is left alone, so an engine whose requests ask for none
    never writes these buffers."""

    def __init__(self, buffers: LogitsBuffers) -> None:
        self.buffers = buffers
        self.dirty = [False] * buffers.bias.shape[0]

    def take(self, row: int, setup: RowLogits | None) -> None:
        """A request takes `row`: its processing written (setup), or the row made neutral."""
        if setup is not None:
            self.buffers.write_row(row, setup)
            self.dirty[row] = True
        elif self.dirty[row]:
            self.buffers.reset_row(row)
            self.dirty[row] = False

    def move(self, src: int, dst: int) -> None:
        if self.dirty[src] or self.dirty[dst]:
            self.buffers.copy_row(src, dst)
            self.dirty[dst] = self.dirty[src]


def process_first(lb: LogitsBuffers, logits: torch.Tensor, rows: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """The first tokens' logits [n, 1, V] processed as a decode step's (a tree of its root, which the
    output does not hold yet) for rows `rows`."""
    n = logits.shape[0]
    zero = torch.zeros(n, 1, dtype=torch.long, device=logits.device)
    ones = torch.ones(n, 1, 1, dtype=torch.bool, device=logits.device)
    return process_logits(logits, lb.rows(rows), zero, zero, zero, ones, temp)


def commit_first(lb: LogitsBuffers, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """Rows `rows` output their first token (tokens [n]): their output state grows by it."""
    view = lb.rows(rows)   # copies (an index), written back
    commit_output(view, tokens[:, None], torch.ones_like(tokens))
    lb.counts[rows], lb.tail[rows], lb.out_len[rows] = view.counts, view.tail, view.out_len


def first_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[Logprobs]:
    """The first tokens' log-probabilities (logits [n, 1, V], the target's own; tokens [n])."""
    lp, ids = token_logprobs(logits, tokens[:, None], k)
    return list(zip(lp[:, 0].tolist(), ids[:, 0].tolist()))


def prompt_logprobs(target: DecoderLM, hidden: torch.Tensor, asks: list[tuple[int, int, PromptAsk]]
                    ) -> dict[int, list[Logprobs]]:
    """The prompt log-probabilities each ask wants: `asks` of (chunk index, the chunk's start,
    PromptAsk) over the forward's hidden states [n, W, D] (every position of every chunk)."""
    out: dict[int, list[Logprobs]] = {}
    for i, start, ask in asks:
        got: list[Logprobs] = []
        at = ask.first - start
        for a in range(0, len(ask.next_ids), PROMPT_SLICE):
            nxt = ask.next_ids[a:a + PROMPT_SLICE]
            logits = target.logits(hidden[i, at + a:at + a + len(nxt)][None])
            lp, ids = token_logprobs(logits, torch.tensor([nxt], device=hidden.device), ask.k)
            got += list(zip(lp[0].tolist(), ids[0].tolist()))
        out[i] = got
    return out
