"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (a token, its log-probability,
its bytes and the `top_logprobs` most likely tokens'), completions' `logprobs` (parallel lists
`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`; with `echo`, the prompt's tokens first,
the first of them without a log-probability), and vLLM's `prompt_logprobs` (per prompt token,
None for the first, then {token id: {logprob, rank, decoded_token}}).

The values are the target's own distribution (`SamplingParams.logprobs`); an entry per token is
([logprob, then the k most likely tokens'], [rank, then their ids]) (`runner.logit_rows.Logprobs`).
"""
from __future__ import annotations

from typing import Any

from drafttree.engine.text import TokenTexts
from drafttree.runner.logit_rows import Logprobs

# JSON has no -inf: the floor OpenAI's and vLLM's servers answer for a token of no probability
FLOOR = -9999.0


def _value(lp: float) -> float:
    return max(lp, FLOOR)


def _top(entry: Logprobs, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of an entry, by rank: (id, logprob)."""
    lps, ids = entry
    return [(t, v) for t, v in zip(ids[1:1 + k], lps[1:1 + k]) if t >= 0]


def chat_content(tokens: list[int], entries: list[Logprobs], k: int, text: TokenTexts) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` items of `tokens`, each with its k most likely tokens."""
    out = []
    for t, entry in zip(tokens, entries):
        s = text(t)
        top = [{"token": text(i), "logprob": _value(v), "bytes": list(text(i).encode())} for i, v in _top(entry, k)]
        out.append({"token": s, "logprob": _value(entry[0][0]), "bytes": list(s.encode()), "top_logprobs": top})
    return out


class CompletionLogprobs:
    """Completions' `logprobs` of one choice, built in pieces (a streamed choice sends each piece
    once): the text offsets run on from one piece to the next."""

    def __init__(self, k: int, text: TokenTexts) -> None:
        self.k, self.text, self.offset = k, text, 0

    def piece(self, tokens: list[int], entries: list[Logprobs | None]) -> dict[str, Any]:
        """The lists of `tokens` (an entry None: a first prompt token, which has no log-probability)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, entry in zip(tokens, entries):
            s = self.text(t)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_value(entry[0][0]))
            top = {self.text(i): _value(v) for i, v in _top(entry, self.k)}
            top.setdefault(s, _value(entry[0][0]))   # the token itself too, as vLLM answers
            out["top_logprobs"].append(top)
        return out


def prompt_logprobs(prompt: tuple[int, ...], entries: tuple[Logprobs, ...], text: TokenTexts
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {id: ...} of the
    token and the most likely ones, ranks 1.. for those."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, (lps, ids) in zip(prompt[1:], entries):
        d = {str(t): {"logprob": _value(lps[0]), "rank": ids[0], "decoded_token": text(t)}}
        for rank, (i, v) in enumerate(_top((lps, ids), len(ids) - 1), start=1):
            d.setdefault(str(i), {"logprob": _value(v), "rank": rank, "decoded_token": text(i)})
        out.append(d)
    return out
