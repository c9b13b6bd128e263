"""Sampling parameters and the target's own token choice at any set of positions.

Randomness is a counter-based hash of (request seed, absolute position, token id) turned into
Gumbel noise. A token sampled at position p therefore depends only on the logits there and the
noise of p: plain decoding, DFlash and DDTree with the same seed commit the same tokens, and the
choice needs no generator state, so it can live inside a CUDA graph.
"""
from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from drafttree.kernels import dispatch
from drafttree.kernels.fused import fused
from drafttree.structured.params import StructuredOutputs

_M32 = 0xFFFFFFFF


DEFAULT_MAX_TOKENS = 256


class ParamError(ValueError):
    """A sampling parameter refused: `param` names it (a request's field of the same name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request samples, in vLLM's names; every field is checked on construction (types
    and ranges, as the server checks a request's), so a bad one fails here, before any work.
    `max_tokens` past what a prompt leaves of the context is refused when the request is queued."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS   # None: up to the context's end
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Speculation for this request: at most this many verified draft nodes per round (None: no
    # cap; 0: never speculated). Rows share a round's width, so a round verifies at most the
    # smallest cap among its requests: a request at 0 makes the rounds it is in decode plainly.
    max_budget: int | None = None
    # The output's form (a JSON schema, any JSON object, a regex, a choice, a grammar): every
    # token is picked among those the grammar allows, and the output ends where it may end.
    structured_outputs: StructuredOutputs | None = None

    # Choices and logits processing, as vLLM's (applied per draft position along each tree path,
    # so speculation stays lossless): n choices sharing the prompt's KV pages, each seeded seed + i;
    # penalties over the output so far (repetition also over the prompt); logit_bias, allowed and
    # banned tokens; min_tokens (end-of-sequence and stop_token_ids masked until then); min_p.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Log-probabilities of the target's own distribution (before any processing or temperature,
    # vLLM's default `raw_logprobs`): of each output token with the `logprobs` most likely tokens;
    # `prompt_logprobs`: of each prompt token after the first, with that many most likely tokens.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    # The output's text, as vLLM's: a stop string, and the stop token or end of sequence that ended
    # the output, are left out of it unless `include_stop_str_in_output`; special tokens are left
    # out unless not `skip_special_tokens` (`spaces_between_special_tokens`: the tokenizer's own
    # option, for tokenizers that have it).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Only the prompt's last k tokens are read (left truncation; -1: as many as the context holds
    # with room for one output token).
    truncate_prompt_tokens: int | None = None

    # vLLM's, not yet taken: each is refused unless it asks for nothing (its default, `NOT_YET`)
    best_of: int | None = None          # also taken equal to n: n choices, all returned
    logits_processors: list | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):   # dataclasses.asdict's copy of one
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        check_params(self)
        if self.structured_outputs is not None and self.ignore_eos:
            raise ParamError("ignore_eos", "ignore_eos cannot be used with structured_outputs: the grammar decides "
                                           "where the output ends")

    def resolved_seed(self) -> int:
        """The request's seed; a fresh random one per request when none was given."""
        return self.seed if self.seed is not None else random.getrandbits(32)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits are processed (penalties, bias, masks, min_p) or their
        log-probabilities read: such a request's rounds run the processed steps."""
        return (self.logprobs is not None or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or self.min_p > 0 or self.min_tokens > 0 or bool(self.logit_bias)
                or self.allowed_token_ids is not None or bool(self.bad_words))


# The fields of SamplingParams not yet taken, each with the values that ask for nothing.
NOT_YET: dict[str, tuple] = {
    "best_of": (None, 1), "logits_processors": (None, []),
}
# The most log-probabilities a request may ask for per token (OpenAI's top_logprobs limit, vLLM's
# default max_logprobs): the rounds' logprob buffers are this wide, whatever a request asks.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_text(text: str, where: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, as JSON's "\\ud800" gives):
    no tokenizer can encode it, and no output can contain it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(where.split(".")[0].split("[")[0],
                         f"{where} is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) at character "
                         f"{e.start}; send text as UTF-8") from None


def check_params(p: SamplingParams) -> None:
    """Every field of p, its type and then its range; normalizes the numbers (float, int) and
    `stop` (a string -> a list). Raises ParamError naming the field."""
    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ParamError(name, f"{name} must be {what}, got {getattr(p, name)!r}")

    need(_is_real(p.temperature) and 0.0 <= p.temperature <= 2.0, "temperature", "a number in [0, 2] (0: greedy)")
    need(_is_real(p.top_p) and 0.0 < p.top_p <= 1.0, "top_p", "a number in (0, 1]")
    need(_is_int(p.top_k) and p.top_k >= -1, "top_k", "an integer: -1 or 0 (off), or >= 1")
    need(p.seed is None or _is_int(p.seed), "seed", "an integer or None")
    need(p.max_tokens is None or (_is_int(p.max_tokens) and p.max_tokens >= 1), "max_tokens",
         "an integer >= 1, or None (up to the context's end)")
    need(p.max_budget is None or (_is_int(p.max_budget) and p.max_budget >= 0), "max_budget",
         "an integer >= 0 (0: no speculation), or None (no cap)")
    need(isinstance(p.ignore_eos, bool), "ignore_eos", "True or False")
    p.temperature, p.top_p, p.top_k = float(p.temperature), float(p.top_p), int(p.top_k)
    p.seed = None if p.seed is None else int(p.seed)
    p.max_tokens = None if p.max_tokens is None else int(p.max_tokens)
    p.max_budget = None if p.max_budget is None else int(p.max_budget)
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    need(isinstance(p.stop, (list, tuple)) and all(isinstance(s, str) for s in p.stop), "stop",
         "a string or a list of strings")
    p.stop = list(p.stop)
    for i, s in enumerate(p.stop):
        if not s:
            raise ParamError("stop", "stop strings must not be empty")
        check_text(s, f"stop[{i}]")
    need(isinstance(p.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in p.stop_token_ids),
         "stop_token_ids", "a list of token ids (integers >= 0)")
    p.stop_token_ids = [int(t) for t in p.stop_token_ids]
    for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
        need(isinstance(getattr(p, name), bool), name, "True or False")
    k = p.truncate_prompt_tokens
    need(k is None or (_is_int(k) and (k >= 1 or k == -1)), "truncate_prompt_tokens",
         "an integer >= 1 (the prompt's last k tokens), -1 (as many as the context holds), or None")
    check_processing(p, need)
    for name, neutral in NOT_YET.items():
        value = getattr(p, name)
        if name == "best_of" and _is_int(value) and value == p.n:
            continue   # as many candidates as choices: all of them returned
        if not _asks_nothing(value, neutral):
            only = f"None or n ({p.n})" if name == "best_of" else _neutral(neutral)
            raise ParamError(name, f"{name}={value!r} is not supported yet (only {only}): this engine "
                                   "does not apply it, so it refuses it rather than ignore it")


def check_processing(p: SamplingParams, need) -> None:
    """The choices', penalties', masks' and logprobs' fields of p (`need(ok, name, what)` refuses);
    normalizes their numbers. Token ids are checked against the vocabulary when the request is
    added (`Engine.add_request`), where the vocabulary is known."""
    need(_is_int(p.n) and p.n >= 1, "n", "an integer >= 1")
    for name in ("presence_penalty", "frequency_penalty"):
        need(_is_real(getattr(p, name)) and -2.0 <= getattr(p, name) <= 2.0, name, "a number in [-2, 2]")
    need(_is_real(p.repetition_penalty) and p.repetition_penalty > 0, "repetition_penalty",
         "a number > 0 (1: off)")
    need(_is_real(p.min_p) and 0.0 <= p.min_p <= 1.0, "min_p", "a number in [0, 1] (0: off)")
    need(_is_int(p.min_tokens) and p.min_tokens >= 0, "min_tokens", "an integer >= 0")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ParamError("min_tokens", f"min_tokens ({p.min_tokens}) must be at most max_tokens ({p.max_tokens})")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        need(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS), name,
             f"an integer in [0, {MAX_LOGPROBS}] (the most likely tokens returned per token), or None")
    if p.logit_bias is not None:
        need(isinstance(p.logit_bias, dict) and all(_is_token(k) for k in p.logit_bias)
             and all(_is_real(v) and abs(v) <= MAX_LOGIT_BIAS for v in p.logit_bias.values()), "logit_bias",
             f"a mapping of token ids (integers >= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        p.logit_bias = {int(k): float(v) for k, v in p.logit_bias.items()}
    if p.allowed_token_ids is not None:
        need(isinstance(p.allowed_token_ids, (list, tuple)) and len(p.allowed_token_ids) > 0
             and all(_is_token(t) for t in p.allowed_token_ids), "allowed_token_ids",
             "a non-empty list of token ids (integers >= 0), or None")
        p.allowed_token_ids = [int(t) for t in p.allowed_token_ids]
    if p.bad_words is not None:
        need(isinstance(p.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in p.bad_words),
             "bad_words", "a list of words (non-blank strings), or None")
        p.bad_words = list(p.bad_words)
        for i, w in enumerate(p.bad_words):
            check_text(w, f"bad_words[{i}]")
    p.presence_penalty, p.frequency_penalty = float(p.presence_penalty), float(p.frequency_penalty)
    p.repetition_penalty, p.min_p = float(p.repetition_penalty), float(p.min_p)
    p.n, p.min_tokens = int(p.n), int(p.min_tokens)


def _is_token(x: object) -> bool:
    return _is_int(x) and x >= 0


def _asks_nothing(value: object, neutral: tuple) -> bool:
    # True == 1 in Python, but n=True asks for something else than n=1
    return any(value is v if v is None or isinstance(v, bool) else (not isinstance(value, bool) and value == v)
               for v in neutral)


def _neutral(values: tuple) -> str:
    shown: list[str] = []
    for v in values:   # 0 and 0.0 alike once
        if not any(v == w and type(v) in (int, float) and type(w) in (int, float) for w in values[:values.index(v)]):
            shown.append(repr(v))
    return " or ".join(shown)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device (rows = batch rows)."""
    temperature: torch.Tensor  # [R] float; 0 = greedy
    top_p: torch.Tensor        # [R] float
    top_k: torch.Tensor        # [R] long; 0 = off
    seed: torch.Tensor         # [R] long

    @classmethod
    def empty(cls, rows: int, device: torch.device | str) -> "SamplingTensors":
        return cls(torch.zeros(rows, device=device), torch.ones(rows, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device))

    def set_row(self, row: int, p: SamplingParams, seed: int) -> None:
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = max(p.top_k, 0)
        self.seed[row] = seed & _M32

    def copy_row(self, src: int, dst: int) -> None:
        for t in (self.temperature, self.top_p, self.top_k, self.seed):
            t[dst] = t[src]


def _mix(x: torch.Tensor) -> torch.Tensor:
    # 32-bit integer hash in int64 arithmetic (all products stay below 2**63).
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """seed [R], positions [R, N] -> Gumbel(0, 1) noise [R, N, V], a pure function of its inputs."""
    key = _mix(_mix(seed[:, None] & _M32) ^ (positions & _M32))          # [R, N]
    ids = torch.arange(vocab, device=positions.device, dtype=torch.long)
    h = _mix(key[..., None] ^ ((ids * 0x27D4EB2D) & _M32))               # [R, N, V]
    return -torch.log(-torch.log(uniform(h)))


def uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 in (0, 1), both ends excluded."""
    # 23 bits, so that u < 1 in float32: with 24, the top value rounded to 1.0 and its noise
    # was +inf, which took that token whatever its probability, and a masked or filtered
    # token's -inf + inf (NaN) won the argmax (one pick in ~340 over a 49k vocabulary)
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def filter_thresholds(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """What top-k, then top-p, keep at each row/node, as one threshold: thr [R, N] float32 of
    logits [R, N, V] (float32 or bf16) at temperature temp [R], top_k [R] (0: off), top_p [R]
    (1: off). The kept tokens are those with logits >= thr.

    Top-k keeps x_i iff fewer than k logits are greater (ties with the k-th are kept). Top-p
    then, over that set K and q = softmax(x / T) restricted to K, keeps x_i iff the mass of K's
    strictly greater logits is below p (ties kept; the max always). So thr is the smallest kept
    logit, exactly, or -inf where nothing is filtered (k 0 or >= V and p 1; rows at T = 0). On
    CUDA with triton a radix descent finds it without a sort (`filter_kernel`), elsewhere a sort
    (`torch_ops.thresholds_by_sort`): `dispatch.filter_thresholds` chooses."""
    return dispatch.filter_thresholds(logits, temp, top_k, top_p)


class SampleMode(IntEnum):
    """What a batch needs from the sampler, known on the host when the batch is formed."""
    GREEDY = 0      # every row at temperature 0
    SAMPLE = 1      # some row samples; no row uses top-k / top-p
    FILTERED = 2    # some row uses top-k / top-p (also correct for any batch)

    @classmethod
    def of(cls, params: list[SamplingParams]) -> "SampleMode":
        sampled = [p for p in params if not p.greedy]
        if not sampled:
            return cls.GREEDY
        return cls.FILTERED if any(p.top_k > 0 or p.top_p < 1.0 for p in sampled) else cls.SAMPLE


def pick_thresholds(logits: torch.Tensor, st: SamplingTensors, mode: SampleMode) -> torch.Tensor | None:
    """The top-k / top-p thresholds [R, N] the filtered mode picks by (None in the other modes)."""
    if mode is not SampleMode.FILTERED:
        return None
    R = logits.shape[0]
    return filter_thresholds(logits, st.temperature[:R], st.top_k[:R], st.top_p[:R])


def pick_tokens(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor,
                mode: SampleMode, thr: torch.Tensor | None = None) -> torch.Tensor:
    """The target's choice at every row/node. logits [R, N, V] float; positions [R, N] are the
    absolute positions of the tokens being chosen. Greedy rows take the argmax. `thr`: the
    filtered mode's thresholds where the caller has them (`pick_thresholds`)."""
    if mode is SampleMode.GREEDY:
        return logits.argmax(dim=-1)
    R = logits.shape[0]
    temp, seed = st.temperature[:R], st.seed[:R]
    if mode is SampleMode.SAMPLE:
        return sample_rows(logits, temp, seed, positions)
    # top-k / top-p: one threshold per row/node, ahead of the compiled piece, which masks by it
    return sample_rows(logits, temp, seed, positions, thr if thr is not None else pick_thresholds(logits, st, mode))


def at_temperature(logits: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    return logits / torch.where(temp > 0, temp, 1.0)[:, None, None]


# Uncompiled, `sample_rows` holds a few int64 and fp32 temporaries of [R, N, V] (~40 bytes a
# logit) where compiled it holds none: its torch ops take at most this many logits at a time, which
# keeps them inside the graph pools' estimate (`graph_plan`) at every batch a server captures.
EAGER_SAMPLE_LOGITS = 1 << 25


def _sample_rows_in_chunks(logits: torch.Tensor, temp: torch.Tensor, seed: torch.Tensor,
                           positions: torch.Tensor, thr: torch.Tensor | None = None) -> torch.Tensor:
    R, N, V = logits.shape
    rows = max(1, EAGER_SAMPLE_LOGITS // (N * V))
    if R <= rows:
        return _sample_rows(logits, temp, seed, positions, thr)
    return torch.cat([_sample_rows(logits[r:r + rows], temp[r:r + rows], seed[r:r + rows], positions[r:r + rows],
                                   None if thr is None else thr[r:r + rows]) for r in range(0, R, rows)])


def _sample_rows(logits: torch.Tensor, temp: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor,
                 thr: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel-max over the logits at each row's temperature (with `thr` [R, N], over those whose
    logits are >= thr: see `filter_thresholds`), the argmax of `logits` where the temperature is
    0. On CUDA this compiles to one or two reductions instead of ~25 launches over [R, N, V] (the
    hash, the noise, the scaling, the mask); uncompiled (on CPU, a server's start) these torch ops
    run a few rows at a time (`EAGER_SAMPLE_LOGITS`)."""
    scaled = at_temperature(logits, temp)
    if thr is not None:   # logits, not scaled ones, against thr: exact however the division rounds
        scaled = torch.where(logits >= thr[..., None], scaled, float("-inf"))
    sampled = (scaled + gumbel_noise(seed, positions, logits.shape[-1])).argmax(dim=-1)
    return torch.where((temp > 0)[:, None], sampled, logits.argmax(dim=-1))


sample_rows = fused(_sample_rows, eager=_sample_rows_in_chunks)
