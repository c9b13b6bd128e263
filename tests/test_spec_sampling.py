"""Speculative decoding at temperature > 0 samples from the target's own distribution.

A tiny vocabulary makes the whole distribution of short continuations enumerable: the exact
probability of every first token and every 3-token continuation is computed from the Hugging
Face model itself, with Hugging Face's temperature / top-k / top-p warpers, and the empirical
distributions of plain decoding, DFlash and DDTree (each from its own set of seeds) are
compared with it by a chi-square test.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from drafttree import LLM, SamplingParams
from tests.tiny import make_drafter, make_target

V = 6
PROMPT = [1, 4, 2]
STEPS = 3
N = 600
P_MIN = 1e-3

VARIANTS = {
    "t1.0": {"temperature": 1.0},
    "t0.8-k3": {"temperature": 0.8, "top_k": 3},
    "t1.2-p0.75": {"temperature": 1.2, "top_p": 0.75},
    "t1.0-k4-p0.8": {"temperature": 1.0, "top_k": 4, "top_p": 0.8},
}
# (block size, budget, draft quantization); ddtree-fp8: the drafter's weights as e4m3 (models/quant.py)
# (block size, budget, drafter quantization): fixed budgets, each method in every round (DFlash: any
# budget; the per-round choice is tests/test_adaptive.py's)
METHODS = {"none": (None, None, None), "dflash": (4, 1, None), "ddtree": (4, 8, None),
           "ddtree-fp8": (4, 8, "fp8")}
CASES = [(m, v) for v in VARIANTS for m in METHODS
         if (v != "t1.0-k4-p0.8" or m != "dflash") and (m != "ddtree-fp8" or v in ("t1.0", "t1.0-k4-p0.8"))]


# -- chi-square ------------------------------------------------------------------------------

def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for X ~ chi-square with k degrees of freedom: the regularized upper
    incomplete gamma function Q(k/2, x/2) (series below a+1, continued fraction above)."""
    a, z = k / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        n = a
        while term > total * 1e-16:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int, float]:
    """Pearson's statistic over the cells of nonzero probability; cells expecting fewer than
    5 are pooled into one. Returns (statistic, degrees of freedom, p-value)."""
    cells, pooled_exp, pooled_obs = [], 0.0, 0
    for key, p in probs.items():
        if p <= 0:
            continue
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            pooled_exp += e
            pooled_obs += o
        else:
            cells.append((o, e))
    if pooled_exp > 0:
        if pooled_exp < 5 and cells:   # too small to stand alone: fold it into the smallest cell
            o, e = min(cells, key=lambda c: c[1])
            cells.remove((o, e))
            cells.append((o + pooled_obs, e + pooled_exp))
        else:
            cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return stat, df, chi2_sf(stat, df)


def test_top_p_one_keeps_the_whole_vocabulary():
    """A top-p batch's rows without top-p pass through the filter too: at top-p 1 no token may
    be masked, though fp32's running sum of a long tail reaches 1.0 (it once masked thousands
    per row)."""
    from drafttree.sampling import filter_thresholds
    logits = torch.randn(4, 2, 49152, generator=torch.Generator().manual_seed(0)) * 3
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0])
    thr = filter_thresholds(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), top_p)
    kept = logits >= thr[..., None]
    assert kept[[0, 1, 3]].all()
    probs = logits[2].softmax(-1)
    assert 0.9 <= (probs * kept[2]).sum(-1).min() and kept[2].sum(-1).max() < 49152 // 2


def test_the_noise_is_finite_at_every_hash_so_a_masked_token_is_never_picked():
    """Gumbel noise from the extreme hashes stays finite: +inf noise would take its token
    whatever its probability, and on a masked (-inf) or filtered token gives NaN, which wins an
    argmax (it came once in ~340 picks over a 49k vocabulary)."""
    from drafttree.sampling import uniform
    h = torch.tensor([0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 2, (1 << 32) - 1], dtype=torch.long)
    u = uniform(h)
    assert ((u > 0) & (u < 1)).all(), u
    noise = -torch.log(-torch.log(u))
    assert torch.isfinite(noise).all(), noise
    logits = torch.full((len(h),), float("-inf"))
    logits[2] = 0.0
    assert (logits + noise).argmax() == 2   # the one allowed token, whatever the others' noise


def test_chi2_sf_closed_forms():
    for x in (0.1, 1.0, 3.84, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-9)
        assert chi2_sf(x, 6) == pytest.approx(math.exp(-x / 2) * (1 + x / 2 + x * x / 8), rel=1e-9)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(124.342, 100) == pytest.approx(0.05, abs=1e-4)


# -- models and exact distributions ------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = make_target(root / "target", "llama", vocab=V)
    return target, make_drafter(root / "drafter", target, block_size=4)


@pytest.fixture(scope="module")
def llms(pair):
    target, drafter = pair
    built: dict[str, LLM] = {}

    def get(method: str) -> LLM:
        if method not in built:
            bs, budget, quantization = METHODS[method]
            built[method] = LLM(model=str(target), draft_model=None if method == "none" else str(drafter),
                                spec=method.split("-")[0], block_size=bs, budget=budget, device="cpu",
                                dtype="float32", max_num_seqs=8, max_model_len=64,
                                draft_quantization=quantization)
        return built[method]

    return get


def warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Hugging Face's sampling distribution: temperature, then top-k, then top-p, as
    GenerationMixin orders its warpers. logits [R, V] -> probabilities [R, V] (float64)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.double().softmax(-1)


def top_p_margin(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> float:
    """How far every token's preceding probability mass is from the top-p threshold: with a
    margin, float rounding cannot decide which tokens are kept."""
    if top_p >= 1.0:
        return 1.0
    probs = warp(logits, temperature, top_k)
    s = probs.sort(-1, descending=True).values
    before = s.cumsum(-1) - s
    return float((before - top_p).abs()[s > 0].min())


@pytest.fixture(scope="module")
def hf_logits(pair):
    """The target's next-token logits after PROMPT + every continuation of 0, 1 and 2 tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for d in range(STEPS):
            conts = list(itertools.product(range(V), repeat=d))
            ids = torch.tensor([PROMPT + list(c) for c in conts])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
            out.update({c: logits[i] for i, c in enumerate(conts)})
    return out


def exact_distribution(hf_logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """{(t1,): p} for the first token and {(t1, t2, t3): p} for 3-token continuations."""
    def step(prefix):
        return warp(hf_logits[prefix][None], temperature, top_k, top_p)[0].tolist()

    first = {(t,): p for t, p in enumerate(step(()))}
    seqs = {}
    for t1, p1 in enumerate(step(())):
        q = step((t1,))
        for t2 in range(V):
            r = step((t1, t2))
            for t3 in range(V):
                seqs[t1, t2, t3] = p1 * q[t2] * r[t3]
    assert math.isclose(sum(seqs.values()), 1.0, abs_tol=1e-9)
    return first, seqs


_samples: dict = {}


def sample(llms, method: str, variant: str):
    """N continuations of PROMPT, one seed each; every (method, variant) has its own seeds, so
    the samples are independent draws and not copies of each other."""
    key = (method, variant)
    if key not in _samples:
        base = 1_000_000 * (1 + list(METHODS).index(method)) + 10_000 * list(VARIANTS).index(variant)
        params = [SamplingParams(seed=base + i, max_tokens=STEPS, ignore_eos=True, **VARIANTS[variant])
                  for i in range(N)]
        outs = llms(method).generate([PROMPT] * N, params)
        for o in outs:
            assert len(o.token_ids) == STEPS and o.finish_reason == "length"
        _samples[key] = outs
    return _samples[key]


def counts_of(outs, k: int) -> dict:
    c: dict = {}
    for o in outs:
        key = tuple(o.token_ids[:k])
        c[key] = c.get(key, 0) + 1
    return c


# -- the distribution test ---------------------------------------------------------------------

@pytest.mark.parametrize("method,variant", CASES)
def test_samples_follow_target_distribution(llms, hf_logits, method, variant):
    cfg = VARIANTS[variant]
    for prefix in hf_logits.values():
        assert top_p_margin(prefix[None], cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0)) > 1e-4
    first, seqs = exact_distribution(hf_logits, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0))
    outs = sample(llms, method, variant)
    for k, probs in ((1, first), (STEPS, seqs)):
        counts = counts_of(outs, k)
        impossible = {s: c for s, c in counts.items() if probs[s] == 0}
        assert not impossible, f"{method}/{variant}: sampled continuations the filters exclude: {impossible}"
        stat, df, p = chi_square(counts, probs, N)
        assert df >= (1 if k == 1 else 4), (k, df)
        assert p > P_MIN, f"{method}/{variant}, {k}-token prefixes: chi2={stat:.1f} df={df} p={p:.2e}"
    if method.startswith("ddtree") or (method == "dflash" and variant == "t1.0"):
        # (elsewhere DFlash's single draft here is a token that the filters remove)
        taus = [t for o in outs for t in o.metrics["accept_lengths"]]
        assert max(taus) >= 2, "no drafted token was ever accepted: only bonus tokens were sampled"


def test_chi_square_detects_a_wrong_temperature(llms, hf_logits):
    """Control: the same test rejects the plain sample at temperature 1.0 against the
    distribution of temperature 0.7, and the top-k sample against the unfiltered one."""
    outs = sample(llms, "none", "t1.0")
    for k, probs in zip((1, STEPS), exact_distribution(hf_logits, 0.7)):
        assert chi_square(counts_of(outs, k), probs, N)[2] < P_MIN
    outs = sample(llms, "ddtree", "t0.8-k3")
    _, seqs = exact_distribution(hf_logits, 0.8)
    assert chi_square(counts_of(outs, STEPS), seqs, N)[2] < P_MIN


# -- seeds -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def seed_llms(tmp_path_factory, pair):
    """A 97-token pair besides the 6-token one, and engines for every method on both."""
    root = tmp_path_factory.mktemp("seeds")
    target = make_target(root / "target", "qwen3", vocab=97)
    big = (target, make_drafter(root / "drafter", target, block_size=4))
    engines = {}
    for name, (t, d) in (("v6", pair), ("v97", big)):
        for method, bs, budget in (("none", None, None), ("dflash", 4, 1), ("dflash", 8, 1),
                                   ("ddtree", 4, 8), ("ddtree", 8, 64)):
            engines[name, method, bs, budget] = LLM(
                model=str(t), draft_model=None if method == "none" else str(d), spec=method, block_size=bs,
                budget=budget, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128)
    return engines


SEED_VARIANTS = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.9}]


@pytest.mark.parametrize("vocab", ["v6", "v97"])
def test_same_seed_same_output_across_methods(seed_llms, vocab):
    vsize = 6 if vocab == "v6" else 97
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vsize, (n,), generator=g).tolist() for n in (1, 9, 25)]
    reqs = [(p, SamplingParams(seed=seed, max_tokens=30, ignore_eos=True, **sv))
            for p in prompts for seed in (11, 12, 13) for sv in SEED_VARIANTS]
    results = {}
    accepted = 0
    for key, llm in seed_llms.items():
        if key[0] != vocab:
            continue
        outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        results[key] = [o.token_ids for o in outs]
        accepted += sum(t >= 2 for o in outs for t in o.metrics["accept_lengths"])
    reference = results[vocab, "none", None, None]
    for key, got in results.items():
        for i, (a, b) in enumerate(zip(got, reference)):
            assert a == b, f"{key}: request {i} ({len(reqs[i][0])}-token prompt, {reqs[i][1]})"
    # different seeds (same prompt, same parameters) give different outputs
    by_case: dict = {}
    for (p, sp), toks in zip(reqs, reference):
        by_case.setdefault((tuple(p), sp.temperature), []).append(tuple(toks))
    for outputs in by_case.values():
        assert len(set(outputs)) == len(outputs), outputs
    if vocab == "v6":
        assert accepted > 0, "no drafted token was accepted at temperature > 0"


def test_seeded_output_independent_of_batch(seed_llms):
    """A seeded request gives the same tokens alone or in a batch beside other requests (in
    another cache row, admitted later), and a greedy row in a sampled batch stays greedy."""
    prompt = [3, 1, 4, 1, 5]
    sp = SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    for key, llm in seed_llms.items():
        if key[0] != "v6":
            continue
        (alone,) = llm.generate([prompt], sp)
        (greedy,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        others = [[0, 1], [2] * 9, [5, 4, 3, 2, 1, 0], [1]]
        batch = llm.generate(others + [prompt, prompt],
                             [SamplingParams(temperature=1.0, seed=i, max_tokens=7 + 3 * i) for i in range(4)]
                             + [sp, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)])
        assert batch[4].token_ids == alone.token_ids, key
        assert batch[5].token_ids == greedy.token_ids, key
        assert alone.token_ids != greedy.token_ids
        # and the same request twice in one batch
        twice = llm.generate([prompt, prompt], sp)
        assert twice[0].token_ids == twice[1].token_ids == alone.token_ids, key
