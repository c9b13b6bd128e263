"""Top-k / top-p thresholds: the radix-descent kernel and the sort in torch ops against a plain
reference of their definition (`sampling.filter_thresholds`), and the sampler through them.

Without CUDA the kernel runs under the Triton interpreter on CPU (conftest.py turns it on).

Top-p's decision at a logit compares the mass of the greater ones with p times the kept set's.
The reference sums in float64, the torch ops in float64 from float32 terms, the kernel in fixed
point (2**-44 of the max's mass); so their thresholds may differ where p sits within rounding of
such a boundary, and nowhere else. The tests draw each row's p from the middle of a gap of at
least 2 * MARGIN between the boundaries (`safe_top_p`), so that exact equality is the check.
"""
from __future__ import annotations

import math

import pytest
import torch

from drafttree.kernels import filter_kernel
from drafttree.kernels.filter_kernel import filter_thresholds_fused
from drafttree.kernels.torch_ops import thresholds_by_sort
from drafttree.sampling import SampleMode, SamplingTensors, filter_thresholds, gumbel_noise, pick_tokens, sample_rows
from tests.helpers import DEVICE, ON_CPU, TRITON_REASON, interpreted_on_cpu

pytest.importorskip("triton", reason=TRITON_REASON)

MARGIN = 1e-5
NEG = float("-inf")


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)


def _kept_and_above(x: torch.Tensor, temp: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct logits of row x [V] that top-k keeps, descending, and the share of the kept
    set's mass (at temp) held by the greater logits, in float64."""
    s = x.double().sort(descending=True).values
    V = s.numel()
    if 0 < k < V:
        s = s[s >= s[k - 1]]
    values, counts = s.unique_consecutive(return_counts=True)
    mass = torch.exp((values - values[0]) / temp) * counts
    mass = torch.where(values > NEG, mass, 0.0)
    return values, (mass.cumsum(0) - mass) / mass.sum()


def reference(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition, row by row: the smallest logit kept by top-k, then by top-p (the mass of
    the strictly greater kept ones below p of the kept set's), or -inf where nothing is filtered."""
    R, N, V = logits.shape
    out = torch.full((R, N), NEG, dtype=torch.float64)
    for r in range(R):
        T, k, p = float(temp[r]), int(top_k[r]), float(top_p[r])
        use_k, use_p = 0 < k < V, p < 1.0
        if T == 0 or not (use_k or use_p):
            continue
        for n in range(N):
            values, above = _kept_and_above(logits[r, n], T, k if use_k else 0)
            if use_p and values[0] > NEG:
                out[r, n] = values[int((above < p).sum()) - 1]
            elif use_k:
                out[r, n] = values[-1]
    return out.float()


def safe_top_p(x: torch.Tensor, temp: float, k: int, want: float) -> float:
    """A top-p near `want` for the rows x [N, V]: the middle of the gap between boundaries (the
    shares of `_kept_and_above`, over all of x's rows) nearest to it of width >= 2 * MARGIN."""
    levels = torch.cat([_kept_and_above(row, temp, k)[1] for row in x] + [torch.tensor([0.0, 1.0]).double()])
    levels = levels.unique().sort().values
    mid = (levels[1:] + levels[:-1]) / 2
    mid = mid[(levels[1:] - levels[:-1]) >= 2 * MARGIN]
    return float(mid[(mid - want).abs().argmin()])


# Per row: (temperature, top_k, top_p wanted); None top_p: 1 (off).
MIXED = [(0.8, 20, 0.9), (1.0, 0, 0.7), (1.3, 7, None), (0.0, 5, 0.5), (0.7, 0, None), (1.0, 3, 0.2)]


def make_case(gen: torch.Generator, R: int, N: int, V: int, rows=MIXED, scale: float = 3.0,
              quantum: float | None = None, neg_inf: float = 0.0, dtype: torch.dtype = torch.float32):
    logits = torch.randn(R, N, V, generator=gen) * scale
    if quantum:   # few distinct values: ties at every boundary
        logits = (logits / quantum).round() * quantum
    if neg_inf:
        logits[torch.rand(R, N, V, generator=gen) < neg_inf] = NEG
    logits = logits.to(dtype)
    temp, top_k, top_p = torch.zeros(R), torch.zeros(R, dtype=torch.long), torch.ones(R)
    for r in range(R):
        T, k, p = rows[r % len(rows)]
        temp[r], top_k[r] = T, k
        if p is not None:
            top_p[r] = safe_top_p(logits[r], T if T > 0 else 1.0, k, p)
    return logits.to(DEVICE), temp.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)


def check(logits, temp, top_k, top_p, chunk: int | None = None) -> torch.Tensor:
    """The kernel's thresholds (and kept sets) equal the reference's and the torch ops'."""
    want = reference(logits.cpu(), temp.cpu(), top_k.cpu(), top_p.cpu())
    got = filter_thresholds_fused(logits, temp, top_k, top_p, interpret=ON_CPU, chunk=chunk).cpu()
    by_sort = thresholds_by_sort(logits, temp, top_k, top_p).cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want), (got, want)
    assert torch.equal(by_sort, want), (by_sort, want)
    x = logits.cpu().float()
    assert torch.equal(x >= got[..., None], x >= want[..., None])
    return got


@pytest.mark.parametrize("R,N,V,chunk", [(1, 1, 300, None), (2, 3, 1000, 256), (6, 2, 777, 512), (3, 1, 2000, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_definition(R, N, V, chunk, dtype):
    """Mixed rows in one batch (top-k, top-p, both, neither, temperature 0), several nodes per
    row, a vocabulary over several chunks that are no multiple of the chunk."""
    gen = torch.Generator().manual_seed(R * 100 + V)
    check(*make_case(gen, R, N, V, dtype=dtype), chunk=chunk)


@pytest.mark.parametrize("quantum", [0.5, 2.0])
def test_ties_at_the_boundary(quantum):
    """Logits of a few distinct values: the k-th value and top-p's last one are shared by many
    tokens, all of which are kept."""
    gen = torch.Generator().manual_seed(int(quantum * 10))
    logits, temp, top_k, top_p = make_case(gen, 6, 2, 600, quantum=quantum)
    thr = check(logits, temp, top_k, top_p, chunk=256)
    x = logits.cpu()
    ties = (x == thr[..., None]).sum(-1)
    assert (ties[thr > NEG] > 1).any()
    kept = (x >= thr[..., None]).sum(-1)
    assert (kept[2] >= 7).all() and (kept[2] > 7).any()   # top-k 7 alone, with ties: more kept


def test_negative_infinity_entries():
    """-inf logits (masked tokens), a row with fewer finite logits than k, a row of only -inf."""
    gen = torch.Generator().manual_seed(5)
    logits, temp, top_k, top_p = make_case(gen, 6, 2, 500, neg_inf=0.4)
    logits[2, 0, :] = NEG
    logits[2, 0, 3] = 1.0          # one finite logit, top-k 7: every token kept
    logits[1, 1, :] = NEG          # nothing finite: nothing filtered
    thr = check(logits, temp, top_k, top_p, chunk=128)
    assert thr[2, 0] == NEG and thr[1, 1] == NEG


def test_extremes_of_k_and_p():
    """k >= V keeps all; k = V - 1 drops the smallest; a tiny p keeps only the max (and its ties);
    p = 1 keeps all; k = 1 keeps the max."""
    gen = torch.Generator().manual_seed(9)
    V = 300
    logits = (torch.randn(5, 2, V, generator=gen) * 3).to(DEVICE)
    logits[3, 1, :4] = logits[3, 1].max() + 1   # the max, 4 times
    temp = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0], device=DEVICE)
    top_k = torch.tensor([V, V + 5, V - 1, 0, 1], device=DEVICE)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1e-6, 1.0], device=DEVICE)
    thr = check(logits, temp, top_k, top_p).to(DEVICE)
    kept = (logits.cpu() >= thr.cpu()[..., None]).sum(-1)
    assert kept[:2].eq(V).all() and kept[2].eq(V - 1).all()
    tied = (logits[3] == logits[3].amax(-1, keepdim=True)).sum(-1).cpu()
    assert tied.tolist() == [1, 4] and torch.equal(kept[3], tied) and kept[4].eq(1).all()


def test_full_vocabulary_and_the_long_tail(monkeypatch):
    """A ~50k vocabulary: top-p 1 keeps every token though the tail's mass is below float32's
    resolution of the total; top-p and top-k rows over it, at the chunking the code plans (with
    wider blocks: fewer interpreted steps)."""
    if ON_CPU:
        monkeypatch.setattr(filter_kernel, "BLOCKS", (1024, 1024))
    gen = torch.Generator().manual_seed(0)
    rows = [(1.0, 0, None), (0.8, 0, 0.95), (1.0, 50, 0.9)]
    logits, temp, top_k, top_p = make_case(gen, 3, 1, 49152, rows=rows)
    thr = check(logits, temp, top_k, top_p)
    assert thr[0, 0] == NEG and thr[1, 0] > NEG and thr[2, 0] > NEG
    kept = (logits.cpu() >= thr.cpu()[..., None]).sum(-1)
    assert 50 < kept[1, 0] < 49152 // 2 and kept[2, 0] <= 50


@pytest.mark.parametrize("want_p", [0.5, 0.9, 0.99, 0.9999])
def test_peaked_rows_where_most_logits_enter_no_histogram(want_p):
    """Language-model-like rows: a few logits far above a wide bulk, so most entries are below
    the bound under which no logit can be the top-p threshold (they count in the total mass
    only). Top-p alone and after top-k, and a flat row (every logit tied)."""
    gen = torch.Generator().manual_seed(int(want_p * 1e4))
    V = 1500
    logits = torch.randn(4, 2, V, generator=gen) * 2
    logits[..., :40] += 14 + torch.rand(4, 2, 40, generator=gen) * 6
    logits[3, 1] = 0.25
    rows = [(1.0, 0), (0.7, 0), (1.2, 30), (1.0, 0)]
    temp = torch.tensor([T for T, _ in rows])
    top_k = torch.tensor([k for _, k in rows])
    top_p = torch.tensor([safe_top_p(logits[r], T, k, want_p) for r, (T, k) in enumerate(rows)])
    thr = check(logits.to(DEVICE), temp.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), chunk=256)
    assert thr[3, 1] == 0.25 and (thr[:3] > 0).all()   # the flat row keeps every logit


def test_chunking_does_not_change_the_threshold():
    """Masses add as integers: any chunking (order of summation) gives the same thresholds, even
    for a p within rounding of a boundary."""
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 1, 1500, generator=gen) * 2).to(DEVICE)
    temp = torch.tensor([0.9, 1.1], device=DEVICE)
    top_k = torch.tensor([0, 40], device=DEVICE)
    top_p = torch.tensor([0.8, 0.9], device=DEVICE)
    runs = [filter_thresholds_fused(logits, temp, top_k, top_p, interpret=ON_CPU, chunk=c) for c in (256, 768, 1500)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def old_filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The sorted top-k / top-p mask that `filter_thresholds` replaced (on logits at temperature)."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k, V)[:, None, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, NEG)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p[:, None, None]) & (top_p < 1.0)[:, None, None]
    drop[..., 0] = False
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(drop, NEG))


def test_picks_as_before_on_untied_logits():
    """Without ties the thresholds keep the tokens the sorted mask kept, and `sample_rows` masking
    by them (kernel or torch ops) picks what the Gumbel-max over the old filtered logits picked."""
    gen = torch.Generator().manual_seed(21)
    R, N, V = 6, 3, 400
    logits, temp, top_k, top_p = (t.cpu() for t in make_case(gen, R, N, V))
    st = SamplingTensors.empty(R, "cpu")
    st.temperature.copy_(temp)
    st.top_k.copy_(top_k)
    st.top_p.copy_(top_p)
    st.seed.copy_(torch.arange(R) + 3)
    pos = torch.arange(N)[None, :] + 17 + torch.arange(R)[:, None]
    scaled = logits / torch.where(temp > 0, temp, 1.0)[:, None, None]
    old = old_filter_logits(scaled, top_k, top_p)
    thr = filter_thresholds_fused(logits.to(DEVICE), temp.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE),
                                  interpret=ON_CPU).cpu()
    sampled = temp > 0
    assert torch.equal((logits >= thr[..., None])[sampled], (old > NEG)[sampled])
    want = (old + gumbel_noise(st.seed, pos, V)).argmax(-1)
    want = torch.where(sampled[:, None], want, logits.argmax(-1))
    assert torch.equal(pick_tokens(logits, st, pos, SampleMode.FILTERED), want)
    assert torch.equal(sample_rows(logits, temp, st.seed, pos, thr), want)
    assert torch.equal(filter_thresholds(logits, temp, top_k, top_p), thr)   # CPU: the torch ops


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 49152), (16, 32, 49152), (1, 33, 151936)])
def test_cuda_graphed_matches_the_sort(shape):
    from drafttree.bench.graph_timer import graphed
    R, N, V = shape
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(R, N, V, device="cuda", generator=gen) * 3
    temp = torch.full((R,), 0.8, device="cuda")
    top_k = torch.tensor([0, 50] * R, device="cuda")[:R]
    top_p = torch.full((R,), 0.95, device="cuda")
    kernel_us, thr = graphed(lambda: filter_thresholds(logits, temp, top_k, top_p), n=1, replays=50)
    sort_us, want = graphed(lambda: thresholds_by_sort(logits, temp, top_k, top_p), n=1, replays=50)
    # rows whose p sits within rounding of a boundary may differ: few, and by one distinct value
    assert (thr == want).float().mean() > 0.99
    print(f"\n{shape}: kernel {kernel_us:.1f} us, sort {sort_us:.1f} us (CUDA graph replay)")


def test_plan_spreads_few_rows_and_keeps_many_whole():
    """The chunks the H200 measured fastest (filter_kernel.MIN_CHUNK's comment)."""
    plan = filter_kernel.chunk_plan
    assert plan(1, 49152) == (24, 2048) and plan(1, 151936) == (38, 4096)
    assert plan(33, 151936) == (19, 8192) and plan(512, 49152) == (6, 8192) and plan(1, 300) == (1, 2048)
    assert math.prod(plan(3, 1000, chunk=300)) >= 1000
