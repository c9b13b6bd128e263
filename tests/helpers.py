"""What several test modules share besides fixtures (those are in conftest.py): the device the
kernel tests run on, the `gpu` parameter, and plain-vs-speculative decoding on tiny random pairs."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from drafttree import LLM, SamplingParams

# -- device --------------------------------------------------------------------------------------

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"
TRITON_REASON = "the kernels are Triton programs (its interpreter runs them on CPU)"
# for a test of a module that is not all kernel tests; those modules importorskip triton themselves
requires_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason=TRITON_REASON)


def gpu(*values, id: str | None = None):  # noqa: A002  (pytest.param's own keyword)
    """A parameter set that only a GPU runs: marked `gpu`, so that conftest deselects it without
    CUDA instead of generating a case that always skips."""
    return pytest.param(*values, marks=pytest.mark.gpu, id=id)


def interpreted_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA, run Triton kernels under the interpreter, which conftest turned on when it
    imported triton; skip where triton came in without it (imported before conftest)."""
    if ON_CPU:
        triton = sys.modules.get("triton") or pytest.importorskip("triton", reason=TRITON_REASON)
        if type(triton.language.standard.flip).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# -- decoding on tiny pairs ------------------------------------------------------------------------

VOCAB = 7            # a random drafter guesses right about 1 time in 7
SCALE = 3.0          # sharper random targets: their greedy outputs vary instead of repeating one token
LENS = (1, 7, 30)
MAX_TOKENS = 40


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_prompts(vocab: int, lens=LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def every_round(spec: str, budget: int | None) -> int | None:
    """A budget for `spec` that drafts in every round. The default, auto, chooses per round by the
    rounds' measured seconds, so its accepted lengths follow the machine's load (its tokens do
    not: tests/test_adaptive.py checks them)."""
    if budget is None and spec != "none":
        return 32 if spec == "ddtree" else 1
    return budget


@dataclass
class Pair:
    """A random target, a random drafter for it (block size 4), and cached plain outputs."""
    target: Path
    drafter: Path
    vocab: int
    _plain: dict = field(default_factory=dict)
    _llms: dict = field(default_factory=dict)

    def llm(self, spec: str = "none", block_size: int | None = None, budget: int | None = None,
            max_num_seqs: int = 3, max_model_len: int = 128, drafter: Path | None = None) -> LLM:
        """One engine per configuration, reused across tests (so engines also serve several
        generate calls in a row, over cache rows that earlier requests left dirty)."""
        budget = every_round(spec, budget)
        key = (spec, block_size, budget, max_num_seqs, max_model_len, drafter)
        if key not in self._llms:
            self._llms[key] = LLM(model=str(self.target),
                                  draft_model=None if spec == "none" else str(drafter or self.drafter),
                                  spec=spec, block_size=block_size, budget=budget, device="cpu",
                                  dtype="float32", max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        return self._llms[key]

    def plain(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """Reference: plain greedy decoding, one request at a time."""
        key = (tuple(prompt), max_tokens)
        if key not in self._plain:
            (out,) = self.llm("none", max_num_seqs=1).generate([prompt], greedy(max_tokens))
            assert len(out.token_ids) == max_tokens
            self._plain[key] = out.token_ids
        return self._plain[key]


def check_lossless(pair: Pair, llm: LLM, prompts, max_tokens=MAX_TOKENS, *, max_tau: int):
    """Generate all prompts in one call; every output must equal plain greedy decoding, and the
    per-round metrics must be consistent with it."""
    params = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    outs = llm.generate(prompts, [greedy(n) for n in params])
    for p, n, out in zip(prompts, params, outs):
        want = pair.plain(p, n)
        assert out.token_ids == want, f"prompt of {len(p)} tokens diverged at index " \
            f"{next((i for i, (a, b) in enumerate(zip(out.token_ids, want)) if a != b), len(want))}"
        assert out.finish_reason == "length"
        taus = out.metrics["accept_lengths"]
        assert out.metrics["rounds"] == len(taus)
        assert all(1 <= t <= max_tau for t in taus), taus
        # the prefill gives one token; the last round is the one that reached max_tokens
        if n == 1:
            assert taus == []
        else:
            assert 1 + sum(taus[:-1]) < n <= 1 + sum(taus), (n, taus)
    return outs


def taus_of(outs) -> list[int]:
    return [t for o in outs for t in o.metrics["accept_lengths"]]


# -- the paged engine -------------------------------------------------------------------------------

def make_llm(pair: Pair, spec: str, block_size: int | None, budget: int | None, **kw) -> LLM:
    """A fresh engine over the pair (not cached: the tests vary pages, pools and caching)."""
    kw = {"max_num_seqs": 3, "max_model_len": 128, "device": "cpu", "dtype": "float32", **kw}
    return LLM(model=str(pair.target), draft_model=None if spec == "none" else str(pair.drafter), spec=spec,
               block_size=block_size, budget=every_round(spec, budget), **kw)


def pool_is_whole(llm: LLM) -> None:
    """Nothing runs, and every page is back in the pool."""
    e = llm.engine
    assert not e.has_unfinished()
    assert e.free_pages == e.pool.usable, (e.free_pages, e.pool.usable)
    assert all(r == 0 for r in e.pool.ref), "a page is still held"
    assert (e.runner.state.block_table == 0).all(), "a row still names pages"

def next_turn_reuses_generated_pages(pair: Pair, spec: str, block_size: int | None, budget: int | None) -> None:
    """A follow-up whose prompt is the last prompt and its answer finds the answer's pages in the
    prefix cache (generated, not prefilled) and still gives plain decoding's tokens."""
    (first,) = make_prompts(pair.vocab, lens=(10,), seed=11)
    llm = make_llm(pair, spec, block_size, budget, page_size=4)
    (answer,) = llm.generate([first], greedy(30))
    follow = first + answer.token_ids + [1, 2, 3]
    before = llm.engine.stats.prefix_cache_hits
    (out,) = llm.generate([follow], greedy(12))
    hits = llm.engine.stats.prefix_cache_hits - before
    # all but the pages of the positions its last round (up to max_commit) and the drafter's
    # pending context (as many) could still write when they were offered
    assert hits >= (len(first) + 30 - 1 - 2 * llm.engine.spec.max_commit) // 4 * 4 > len(first), hits
    assert out.token_ids == pair.plain(follow, 12)
    pool_is_whole(llm)


def pool_gb(pair: Pair, spec: str, block_size: int | None, budget: int | None, pages: int, page_size: int,
            **kw) -> float:
    """The KV budget that holds `pages` pages of the pair's target (and drafter), counted from the
    pools' own shapes: K and V each of its width (an MLA target's V has none)."""
    kw = {**kw, "max_num_seqs": 1, "max_model_len": 32, "page_size": page_size}
    probe = make_llm(pair, spec, block_size, budget, **kw)
    r = probe.engine.runner
    per_slot = sum((c.k[:, :, :, 0].numel() + c.v[:, :, :, 0].numel()) * c.k.element_size()
                   for c in (r.kv, r.dkv) if c is not None)
    return (pages * page_size * per_slot + 1) / 2**30


def ref_rms(x, w, eps):
    """RMSNorm written out, for reference forwards."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    """Rotary embedding (rotate-half) of x [T, H, hd] at positions pos [T], written out."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    f = pos[:, None].float() * inv
    emb = torch.cat([f, f], -1)[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * emb.cos() + rot * emb.sin()
