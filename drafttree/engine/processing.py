"""A request's logits processing, from its SamplingParams, when it is added: token ids checked
against the vocabulary, bad words tokenized (as vLLM does: each word as written and, where that
gives another first token of the same length, after a space), and the banned-sequence table's
limits; and its n choices, each seeded as vLLM seeds them (seed + i)."""
from __future__ import annotations

from dataclasses import replace

from drafttree.sampling import ParamError, SamplingParams
from drafttree.spec_decode.logits import RowLogits, ban_limits_message


def row_logits(p: SamplingParams, prompt: list[int], vocab: int, eos_ids: set[int], tokenizer) -> RowLogits | None:
    """The row state p asks for (None: nothing to process), its token ids checked; raises
    ParamError naming the field."""
    if not p.processes_logits:
        return None
    for name, ids in (("logit_bias", list(p.logit_bias or ())), ("allowed_token_ids", p.allowed_token_ids or [])):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ParamError(name, f"{name} names token ids {bad[:5]} outside the vocabulary [0, {vocab})")
    one, words = [], []
    for seq in bad_word_ids(p.bad_words or [], tokenizer):
        (one if len(seq) == 1 else words).append(seq)
    stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))) if p.min_tokens else []
    if p.allowed_token_ids is not None:   # some token must stay pickable
        allowed, banned = set(p.allowed_token_ids), {t for (t,) in one}
        if allowed <= banned:
            raise ParamError("bad_words", "bad_words ban every token allowed_token_ids allows: no token could be picked")
        if allowed <= banned | set(stops):
            raise ParamError("min_tokens", "min_tokens bans the end-of-sequence and stop tokens until then, and "
                             "allowed_token_ids allows no other token: no token could be picked")
    longest = max(map(len, words), default=0)
    for name, count in (("bad_words", len(words)), ("min_tokens", len(words) + len(stops))):
        why = ban_limits_message(count, longest)
        if why is not None:
            raise ParamError(name, why)
    return RowLogits(p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p,
                     dict(p.logit_bias or {}), p.allowed_token_ids, [t for (t,) in one], words, stops,
                     p.min_tokens, prompt if p.repetition_penalty != 1 else [])


def bad_word_ids(words: list[str], tokenizer) -> list[list[int]]:
    """The token sequences `words` ban: each word without leading spaces, and after one space where
    that tokenizes to another first token and as many tokens (a word inside the text)."""
    if words and tokenizer is None:
        raise ParamError("bad_words", "bad_words needs the model's tokenizer; this model has none")
    out: list[list[int]] = []
    for w in words:
        plain = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced) if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,):
            if ids and ids not in out:
                out.append(ids)
    return out


def choice_params(p: SamplingParams) -> list[SamplingParams]:
    """The n choices' parameters: n = 1 each; choice i seeded seed + i (unseeded: each its own
    random seed); prompt log-probabilities asked of the first alone (the prompt is theirs alike)."""
    if p.n == 1:
        return [p]
    return [replace(p, n=1, best_of=None, seed=None if p.seed is None else p.seed + i,
                    prompt_logprobs=p.prompt_logprobs if i == 0 else None) for i in range(p.n)]
