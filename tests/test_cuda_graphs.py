"""CUDA graphs: every phase at its own width. The plan part runs on CPU; replay tests need CUDA."""
from __future__ import annotations

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.engine.engine import EngineConfig
from drafttree.engine.plan import describe_plan
from drafttree.phases import Phase, SpecConfig, batch_buckets
from drafttree.runner.cuda_graph import first_sets, graph_keys, graph_plan, set_keys
from tests.tiny import make_drafter, make_target

cuda = pytest.mark.gpu   # deselected without CUDA (conftest.py)


def run_to_end(eng, prompts: list, params) -> list[list[int]]:
    """Each prompt's output ids, the engine stepped until every request has finished (`params`: one
    for all, or one a prompt)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_unfinished():
        eng.step()
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    t = make_target(root / "t", "qwen3", vocab=61, layers=3, scale=3.0)
    return t, make_drafter(root / "d", t, block_size=8, target_layer_ids=[0, 2])


def test_seed_config_widths_in_plan(pair):
    """The seed's crash: draft block 8, budget 32. Verify must be 33 wide, draft 8."""
    spec = SpecConfig("ddtree", block_size=8, budget=32)
    assert spec.width(Phase.DRAFT) == 8 and spec.width(Phase.VERIFY) == 33
    from drafttree.config import ModelConfig
    t, d = pair
    plan = {e.phase: e for e in graph_plan(spec, ModelConfig.from_dir(t), None, 8, [1024, 4096])}
    assert plan[Phase.DRAFT].width == 8 and plan[Phase.VERIFY].width == 33
    assert plan[Phase.VERIFY].batch_sizes == (1, 2, 4, 8)
    assert plan[Phase.VERIFY].kv_lengths == (1024, 4096)
    text = describe_plan(EngineConfig(model=str(t), draft_model=str(d), spec="ddtree", budget=32))
    assert "verify=33" in text and "draft=8" in text
    from drafttree.runner.model_runner import CacheConfig
    from drafttree.runner.prefill_plan import PrefillLimits
    cache = CacheConfig(256, ModelConfig.from_dir(t).max_position_embeddings, spec.kv_headroom)
    shapes = PrefillLimits(256, 2048, 8192, cache.max_model_len - 1, cache.max_len, tuple(cache.kv_buckets)).shapes()
    offsets = sum(L > 0 for _, _, L in shapes)
    assert offsets and f"prefill graphed: {len(shapes)} graphs" in text
    assert f"{len(shapes) - offsets} from position 0, {offsets} at offsets" in text
    chain = SpecConfig("dflash", block_size=8)
    assert chain.width(Phase.VERIFY) == 8
    assert SpecConfig().round_phases == (Phase.DECODE,) and SpecConfig().width(Phase.DECODE) == 1
    assert batch_buckets(6) == [1, 2, 4, 6]


def test_seed_config_first_request_eager(pair):
    t, d = pair
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = LLM(model=str(t), device="cpu", dtype="float32").generate([[5, 6, 7]], sp)[0].token_ids
    got = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget=32, device="cpu",
              dtype="float32").generate([[5, 6, 7]], sp)[0].token_ids
    assert got == want


def _outputs(t, d, spec, graphs, prompts, sp, max_num_seqs=8, budget=None, dtype="float32"):
    llm = LLM(model=str(t), draft_model=str(d) if spec != "none" else None, spec=spec, budget=budget,
              device="cuda", dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=256, cuda_graphs=graphs)
    outs = llm.generate(prompts, sp)
    return [o.token_ids for o in outs], llm


@cuda
@pytest.mark.parametrize("spec,budget", [("none", None), ("dflash", 1), ("ddtree", 32), ("ddtree", 5)])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_replay_equals_eager(pair, spec, budget, batch, temperature):
    t, d = pair
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 59, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (batch,), generator=g)]
    sp = [SamplingParams(temperature=temperature, top_p=0.9, max_tokens=40, seed=i, ignore_eos=True)
          for i in range(batch)]
    eager, _ = _outputs(t, d, spec, False, prompts, sp, budget=budget)
    graphed, llm = _outputs(t, d, spec, True, prompts, sp, budget=budget)
    assert graphed == eager
    gr = llm.engine.runner.graphs
    assert gr is not None and gr.fallbacks == 0
    widths = {p: llm.engine.spec.width(p) for p in llm.engine.spec.round_phases}
    if spec == "ddtree":
        assert widths[Phase.VERIFY] == budget + 1 and widths[Phase.DRAFT] == 8


@cuda
@pytest.mark.parametrize("spec,budget", [("none", None), ("dflash", 1), ("ddtree", 32)])
def test_bf16_graphs_through_the_fused_projections_equal_eager(pair, spec, budget, monkeypatch):
    """bf16: one-token rows through the GEMVs, verify and draft rows through the few-row kernel
    (given blocks at every weight size, in two input splits and programs of 16 rows), graphed
    against eager."""
    from drafttree.kernels import gemm_kernel
    for kind in gemm_kernel.BLOCKS:
        monkeypatch.setitem(gemm_kernel.BLOCKS, kind, [(0, (32, 64, 4, 3, 2, 16, 64, 2))])
    launches = []
    real = gemm_kernel.launch
    monkeypatch.setattr(gemm_kernel, "launch", lambda *a: launches.append(a[0]) or real(*a))
    t, d = pair
    prompts = [[5, 6, 7], list(range(3, 40))]
    sp = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=1, ignore_eos=True)]
    eager, _ = _outputs(t, d, spec, False, prompts, sp, budget=budget, dtype="bfloat16")
    graphed, llm = _outputs(t, d, spec, True, prompts, sp, budget=budget, dtype="bfloat16")
    assert graphed == eager and llm.engine.runner.graphs.fallbacks == 0
    assert spec == "none" or {"norm", "plain", "glu"} <= set(launches)


@cuda
@pytest.mark.parametrize("spec,budget", [("none", None), ("dflash", 1), ("ddtree", 32)])
def test_bf16_graphs_with_dependent_launches_equal_without(pair, spec, budget, set_settings):
    """Programmatic dependent launch (Hopper): a kernel's programs start while the one before
    runs and load their first weights; graphed tokens equal those of launches that wait."""
    from drafttree.kernels import triton_jit
    if not triton_jit.pdl_on("cuda"):
        pytest.skip("programmatic dependent launch needs a Hopper or newer GPU")
    t, d = pair
    prompts = [[5, 6, 7], list(range(3, 40))]
    sp = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=1, ignore_eos=True)]
    with_pdl, llm = _outputs(t, d, spec, True, prompts, sp, budget=budget, dtype="bfloat16")
    set_settings(pdl=False)
    without, _ = _outputs(t, d, spec, True, prompts, sp, budget=budget, dtype="bfloat16")
    assert with_pdl == without and llm.engine.runner.graphs.fallbacks == 0


@cuda
@pytest.mark.parametrize("spec,budget", [("ddtree", 32), ("ddtree", None)])
def test_graphs_of_uncompiled_pieces_equal_plain_decoding(pair, spec, budget, set_settings):
    """DRAFTTREE_COMPILE=0 on CUDA (the small fused pieces as torch ops, as a start-up without
    torch.compile would run them): every round graphed, no fallback, and the tokens of plain
    decoding at T = 0, fixed budget and `auto` (budget None)."""
    set_settings(compile="0")
    t, d = pair
    prompts = [[5, 6, 7], list(range(3, 40))]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want, _ = _outputs(t, d, "none", False, prompts, sp)
    got, llm = _outputs(t, d, spec, True, prompts, sp, budget=budget)
    assert got == want and llm.engine.runner.graphs.fallbacks == 0


@cuda
@pytest.mark.parametrize("spec,budget", [("dflash", 1), ("ddtree", 32), ("ddtree", 5)])
@pytest.mark.parametrize("batch", [1, 3])
def test_fp32_graphed_speculation_equals_plain_through_the_code_blocks(pair, spec, budget, batch, monkeypatch):
    """Lossless on the GPU at the code's own few-row blocks (tiles for these small weights): the
    verify and draft rows through the tensor-core tiles, plain decoding through the GEMVs. The
    engine sends only 16-bit rows there; here fp32 ones too (the kernels take fp32, and their fp32
    dots are exact products), so that tokens must be equal."""
    from drafttree.kernels import dispatch, gemm_kernel
    monkeypatch.setattr(dispatch, "projection_kernels", lambda x: not torch.is_grad_enabled() and x.is_cuda
                        and x.numel() // x.shape[-1] <= gemm_kernel.MAX_ROWS)
    tiled = []   # per few-row call: did a tile run (a class with blocks, covering its rows)?
    real = gemm_kernel.launch

    def spy(kind, x, *rest):
        blocks, w = gemm_kernel.blocks_for(kind, rest[3].numel()), rest[3]
        tiled.append(blocks is not None and x.numel() // w.shape[1] <= blocks[6])
        return real(kind, x, *rest)
    monkeypatch.setattr(gemm_kernel, "launch", spy)
    t, d = pair
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 59, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (batch,), generator=g)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want, _ = _outputs(t, d, "none", True, prompts, sp)
    got, llm = _outputs(t, d, spec, True, prompts, sp, budget=budget)
    assert got == want and llm.engine.runner.graphs.fallbacks == 0
    assert any(tiled)


@cuda
def test_seed_config_first_request_graphed(pair):
    t, d = pair
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want, _ = _outputs(t, d, "none", False, [[5, 6, 7]], sp)
    got, llm = _outputs(t, d, "ddtree", True, [[5, 6, 7]], sp, budget=32)
    assert got == want
    assert llm.engine.runner.graphs.fallbacks == 0


@cuda
def test_missing_graph_falls_back_eagerly(pair, caplog):
    t, d = pair
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]
    want, _ = _outputs(t, d, "ddtree", False, prompts, sp, budget=16)
    llm = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget=16, device="cuda", dtype="float32",
              max_num_seqs=8, max_model_len=256, cuda_graphs=True)
    gr = llm.engine.runner.graphs
    for k in [k for k in gr.graphs if k[1] == 2]:
        del gr.graphs[k]
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    assert gr.fallbacks > 0
    assert any("no CUDA graph" in r.message for r in caplog.records)


@pytest.mark.parametrize("spec,budget", [("none", None), ("dflash", 1), ("ddtree", 32), ("dflash", "auto"),
                                         ("ddtree", "auto")])
def test_graph_runner_logic_on_cpu(pair, fake_cuda_graphs, spec, budget):
    """Bucketed replay (padding rows parked, batch 3 runs in the bucket of 4) gives eager's tokens."""
    t, d = pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    sp = [SamplingParams(temperature=T, max_tokens=20, seed=i, ignore_eos=True)
          for i, T in enumerate((0.0, 0.9, 0.0))]
    kw = dict(model=str(t), draft_model=str(d) if spec != "none" else None, spec=spec, budget=budget,
              device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128)
    want = [o.token_ids for o in LLM(**kw, cuda_graphs=False).generate(prompts, sp)]
    llm = LLM(**kw, cuda_graphs=True)
    gr = llm.engine.runner.graphs
    assert all(g.fn is not None for g in fake_cuda_graphs)
    assert {k[1] for k in gr.graphs} == {1, 2, 4} and len(gr.kv_lengths) == 1
    # leave a stale, nearly full cache row 3 behind: the bucket of 4 must park it, not run it on
    llm.generate(prompts + [[i % 50 + 1 for i in range(99)]], sp + [SamplingParams(temperature=0.0, max_tokens=27)])
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert gr.fallbacks == 0


def test_each_sampler_mode_replays_its_own_graphs(pair, fake_cuda_graphs):
    """Greedy, unfiltered sampled and top-p batches replay decode and verify graphs captured in
    their own mode (an unfiltered batch in the top-p graph would find thresholds for nothing);
    the drafter's graphs, which pick no token, are one for every mode."""
    from drafttree.sampling import SampleMode
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=128)
    llm = LLM(**kw, cuda_graphs=True)
    gr = llm.engine.runner.graphs
    assert {k[2] for k in gr.graphs} == set(SampleMode) | {None}
    assert {k[0] for k in gr.graphs if k[2] is None} == {Phase.CONTEXT, Phase.DRAFT}
    replayed = []
    for key, g in gr.graphs.items():
        g.replay = lambda mode=key[2], run=g.replay: replayed.append(mode) or run()
    for sp, mode in ((SamplingParams(temperature=0.0), SampleMode.GREEDY),
                     (SamplingParams(temperature=0.8, seed=1), SampleMode.SAMPLE),
                     (SamplingParams(temperature=0.8, top_p=0.9, seed=1), SampleMode.FILTERED)):
        sp.max_tokens, sp.ignore_eos = 12, True
        want = LLM(**kw, cuda_graphs=False).generate([[3, 1, 4]], sp)[0].token_ids
        replayed.clear()
        assert llm.generate([[3, 1, 4]], sp)[0].token_ids == want
        assert replayed and set(replayed) - {None} == {mode}
    assert gr.fallbacks == 0


def test_sampler_modes_capture_only_those_asked(pair, fake_cuda_graphs, monkeypatch, tmp_path):
    """An engine told its requests' sampler mode captures that mode's round graphs alone; a batch
    in another mode still decodes, eagerly, to the same tokens. Regeneration at one temperature
    asks for its mode."""
    import drafttree.train.regen as regen
    from drafttree.sampling import SampleMode
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=128)
    llm = LLM(**kw, cuda_graphs=True, sampler_modes=("greedy",))
    gr = llm.engine.runner.graphs
    assert {k[2] for k in gr.graphs} - {None} == {SampleMode.GREEDY}
    for T in (0.0, 0.8):
        sp = SamplingParams(temperature=T, seed=1, max_tokens=12, ignore_eos=True)
        want = LLM(**kw, cuda_graphs=False).generate([[3, 1, 4]], sp)[0].token_ids
        before = gr.fallbacks
        assert llm.generate([[3, 1, 4]], sp)[0].token_ids == want
        assert (gr.fallbacks > before) == (T > 0)
    built, real = [], regen.make_llm
    monkeypatch.setattr(regen, "make_llm", lambda cfg, **k: built.append(real(cfg, **k)) or built[-1])
    for T, mode in ((0.0, SampleMode.GREEDY), (0.8, SampleMode.SAMPLE)):
        rc = regen.RegenConfig(target=str(t), device="cpu", dtype="float32", max_num_seqs=2, max_tokens=4,
                               temperature=T, cuda_graphs=True)
        regen.regenerate([[5, 6, 7]], tmp_path / f"t{T}.jsonl", rc, progress=False)
        assert {k[2] for k in built[-1].engine.runner.graphs.graphs} - {None} == {mode}


def test_sampler_modes_bad_input_fails_fast(pair):
    """An unknown or empty sampler mode list fails before any weight loads (the model path does
    not exist)."""
    for modes in (("greedy", "beam"), ()):
        with pytest.raises(ValueError, match="sampler_modes"):
            LLM(model="/nonexistent/model", device="cpu", sampler_modes=modes)


def test_per_round_choice_with_one_mode_times_that_mode(pair, fake_cuda_graphs):
    """An engine told its requests are greedy captures and times greedy rounds only: the cost
    model replays its graphs, and prices a sampled round (which runs eagerly, to the same
    tokens) from the greedy entries."""
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget="auto", device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=128)
    llm = LLM(**kw, cuda_graphs=True, sampler_modes=("greedy",))
    costs = llm.engine.costs
    assert costs.seconds and not any(sampled for _, _, _, sampled in costs.seconds)
    assert costs.round_seconds(1, 4, sampled=True) == costs.round_seconds(1, 4)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    want = LLM(**kw, cuda_graphs=False).generate([[3, 1, 4]], sp)[0].token_ids
    assert llm.generate([[3, 1, 4]], sp)[0].token_ids == want


def test_collector_paused_while_capturing(pair, fake_cuda_graphs, monkeypatch):
    """Python's cyclic collector is off inside every capture (the rounds' and the prefills', all
    at start-up), so that nothing it frees makes CUDA calls a capture forbids; it is on again
    afterwards, and serving captures nothing."""
    import contextlib
    import gc
    fake, seen = torch.cuda.graph, []

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        seen.append(gc.isenabled())
        with fake(*args, **kwargs):
            yield
    monkeypatch.setattr(torch.cuda, "graph", graph)
    t, d = pair
    llm = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=128, cuda_graphs=True, prefill_graphs=True)
    runner = llm.engine.runner
    captured = len(seen)
    assert captured == len(runner.graphs.graphs) + len(runner.prefill_graphs.graphs) and runner.prefill_graphs.graphs
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(seen) == captured and not any(seen) and gc.isenabled()


def test_dropped_engine_frees_its_cache_at_once(pair, fake_cuda_graphs):
    """Nothing the runner owns refers back to it (its graphs hold the round context, not the
    runner): dropping an engine frees its runner and KV cache there and then, not whenever
    Python's cyclic collector runs (which had freed an earlier engine's graphs inside another
    engine's capture)."""
    import gc
    import weakref
    t, d = pair
    gc.disable()
    try:
        llm = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
                  max_num_seqs=2, max_model_len=128, cuda_graphs=True, prefill_graphs=True)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
        runner, cache = weakref.ref(llm.engine.runner), weakref.ref(llm.engine.runner.kv.k)
        fake_cuda_graphs.clear()   # the stand-ins' own list (a real graph is held by the runner alone)
        del llm
        assert runner() is None and cache() is None
    finally:
        gc.enable()


def test_budget_schedule_widths_and_plan(pair):
    spec = SpecConfig("ddtree", block_size=8, budget=32, budget_schedule=SpecConfig.parse_schedule("4:8,8:2"))
    assert [spec.width(Phase.VERIFY, b) for b in (1, 2, 3, 4, 7, 8, 64)] == [33, 33, 33, 9, 9, 3, 3]
    assert spec.width(Phase.DRAFT, 8) == 8 and spec.kv_headroom == 33
    from drafttree.config import ModelConfig
    t, _ = pair
    plan = [(e.phase, e.width, e.batch_sizes) for e in graph_plan(spec, ModelConfig.from_dir(t), None, 8, [545])]
    assert (Phase.VERIFY, 33, (1, 2)) in plan and (Phase.VERIFY, 9, (4,)) in plan and (Phase.VERIFY, 3, (8,)) in plan
    for bad in ("8", "a:b", "8:-1", "0:4"):
        with pytest.raises(ValueError):
            SpecConfig("ddtree", 8, 32, SpecConfig.parse_schedule(bad))
    with pytest.raises(ValueError, match="dflash has no budget"):
        SpecConfig("dflash", 8, 0, ((4, 8),))
    with pytest.raises(ValueError, match="needs spec ddtree or dflash"):
        SpecConfig("none", 0, 0, ((4, 0),))


def test_schedule_turns_speculation_off_from_a_batch_size(pair):
    """'4:0': from 4 rows on, rounds are plain decode steps; the plan captures decode graphs at
    every bucket (a request's max_budget of 0 makes any round a decode step)."""
    from drafttree.config import ModelConfig
    t, _ = pair
    spec = SpecConfig("ddtree", block_size=8, budget=32, budget_schedule=SpecConfig.parse_schedule("2:8,4:0"))
    assert [spec.phases_at(b) for b in (1, 2, 4, 8)] == [(Phase.DRAFT, Phase.VERIFY)] * 2 + [(Phase.DECODE,)] * 2
    assert spec.budgets == (8, 32) and spec.kv_headroom == 33 and spec.round_phases == (Phase.DRAFT, Phase.VERIFY)
    entries = graph_plan(spec, ModelConfig.from_dir(t), None, 8, [545])
    plan = [(e.phase, e.width, e.batch_sizes) for e in entries if not e.processed]
    assert plan == [(Phase.CONTEXT, 32, (1, 2, 4, 8)), (Phase.DECODE, 1, (1, 2, 4, 8)), (Phase.DRAFT, 8, (1, 2)),
                    (Phase.VERIFY, 33, (1,)), (Phase.VERIFY, 9, (2,))]
    # processed rounds' decode and verify steps, beside them, in two sampler modes of three
    assert [(e.phase, e.width, e.batch_sizes) for e in entries if e.processed] == plan[1:2] + plan[3:]
    # graphs: buckets x sampler modes (3; processed: 2) x step kinds (plain, constrained); the context once
    # per bucket, the draft once per bucket and kind (they pick no token)
    assert [(e.phase, e.processed, e.graphs) for e in entries] == [
        (Phase.CONTEXT, False, 4), (Phase.DECODE, False, 4 * 3 * 2), (Phase.DECODE, True, 4 * 2 * 2),
        (Phase.DRAFT, False, 2 * 2), (Phase.VERIFY, False, 3 * 2), (Phase.VERIFY, True, 2 * 2),
        (Phase.VERIFY, False, 3 * 2), (Phase.VERIFY, True, 2 * 2)]
    chain = SpecConfig("dflash", block_size=8, budget_schedule=SpecConfig.parse_schedule("2:0"))
    assert chain.phases_at(1) == (Phase.DRAFT, Phase.VERIFY) and chain.phases_at(2) == (Phase.DECODE,)


def test_auto_budgets_and_their_widths():
    """--budget auto: every round may run at 0 or one of the powers of two from 4 up to the
    largest budget, and that itself; a schedule caps them; every width from `SpecConfig.width`."""
    from drafttree.phases import auto_budgets
    assert auto_budgets(31) == (4, 8, 16, 31) and auto_budgets(32) == (4, 8, 16, 32) and auto_budgets(2) == (2,)
    assert SpecConfig.parse_schedule("auto", 32) == ()
    spec = SpecConfig("ddtree", block_size=16, budget=31, budget_schedule=((4, 8), (8, 0)), adaptive=True)
    assert [spec.budgets_at(b) for b in (1, 2, 4, 8)] == [(0, 4, 8, 16, 31)] * 2 + [(0, 4, 8), (0,)]
    assert spec.budgets == (4, 8, 16, 31) and spec.kv_headroom == 32
    assert [spec.width(Phase.VERIFY, 4, n) for n in (4, 8)] == [5, 9] and spec.width(Phase.VERIFY, 1) == 32
    with pytest.raises(AssertionError):
        spec.width(Phase.VERIFY, 4, 16)        # a budget the bucket never runs at
    chain = SpecConfig("dflash", block_size=8, adaptive=True)
    assert chain.budgets_at(1) == (0, 7) and chain.width(Phase.VERIFY, 1, 7) == 8 and chain.budgets == (7,)
    assert SpecConfig("ddtree", 8, 32, sampled=False, adaptive=True).budgets_at(1, greedy=False) == (0,)


def _finishing_at_different_times(t):
    """Six requests of different lengths (mixed T = 0 and 0.8), and plain decoding's tokens."""
    prompts = [[i + 1, 2, 3][: 1 + i % 3] for i in range(6)]
    sp = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6 + 5 * i, ignore_eos=True)
          for i in range(6)]
    want = [o.token_ids for o in LLM(model=str(t), device="cpu", dtype="float32", max_num_seqs=8,
                                     max_model_len=128).generate(prompts, sp)]
    return prompts, sp, want


@pytest.mark.parametrize("graphs", [False, True])
def test_budget_schedule_is_lossless_as_the_batch_shrinks(pair, fake_cuda_graphs, graphs):
    """Requests finish at different times, so rounds move between batch buckets (and budgets)."""
    t, d = pair
    prompts, sp, want = _finishing_at_different_times(t)
    llm = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget=24, budget_schedule="2:6,4:1", device="cpu",
              dtype="float32", max_num_seqs=8, max_model_len=128, cuda_graphs=graphs)
    seen = []
    from drafttree.spec_decode import rounds
    orig = rounds.build_tree

    def spy(logits, root, budget):
        seen.append((logits.shape[0], budget))
        return orig(logits, root, budget)
    rounds.build_tree = spy
    try:
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    finally:
        rounds.build_tree = orig
    assert {(4, 1), (2, 6), (1, 24)} <= set(seen) or {(8, 1), (2, 6), (1, 24)} <= set(seen)


@pytest.mark.parametrize("spec,schedule", [("ddtree", "2:0"), ("dflash", "2:0"), ("ddtree", "2:3,4:0")])
@pytest.mark.parametrize("graphs", [False, True])
def test_speculation_off_under_load_is_lossless(pair, fake_cuda_graphs, spec, schedule, graphs):
    """Six requests start together with speculation off (plain decode rounds keep the drafter's
    context, written by context phases), then drafting resumes as they finish and the batch
    shrinks: plain decoding's tokens."""
    t, d = pair
    prompts, sp, want = _finishing_at_different_times(t)
    llm = LLM(model=str(t), draft_model=str(d), spec=spec, budget=24 if spec == "ddtree" else 1,
              budget_schedule=schedule, device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128,
              cuda_graphs=graphs)
    drafter, calls = llm.engine.runner.drafter, {"context": 0, "draft": 0}
    write_context = drafter.write_context

    def counting_write(*args, **kw):
        calls["context"] += 1
        write_context(*args, **kw)
    drafter.write_context = counting_write
    drafter.register_forward_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert calls["context"] > 1 and calls["draft"] > 0, calls   # prefill and context phases, then drafts


@pytest.mark.parametrize("spec", ["ddtree", "dflash"])
@pytest.mark.parametrize("graphs", [False, True])
def test_sampled_rounds_decode_plainly_when_asked(pair, fake_cuda_graphs, spec, graphs):
    """speculate_sampled=False: a round with a row at T > 0 is a plain decode step (the drafter's
    context kept current), a round of greedy rows drafts; plain decoding's tokens throughout."""
    from drafttree.sampling import SampleMode
    t, d = pair
    prompts, sp, want = _finishing_at_different_times(t)    # the sampled ones finish first
    llm = LLM(model=str(t), draft_model=str(d), spec=spec, budget=24 if spec == "ddtree" else 1,
              speculate_sampled=False, device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128,
              cuda_graphs=graphs)
    runner, drafts, rounds = llm.engine.runner, [0], []
    runner.drafter.register_forward_hook(lambda *_: drafts.__setitem__(0, drafts[0] + 1))
    run_round = runner.run_round

    def spy(B, mode, max_length, budget=None, **kw):
        before = drafts[0]
        run_round(B, mode, max_length, budget, **kw)
        rounds.append((mode, drafts[0] > before))
    runner.run_round = spy
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert not any(drafted for mode, drafted in rounds if mode is not SampleMode.GREEDY)
    assert any(drafted for mode, drafted in rounds if mode is SampleMode.GREEDY)
    assert any(mode is not SampleMode.GREEDY for mode, _ in rounds)
    if graphs:
        assert runner.graphs.fallbacks == 0


def test_speculate_sampled_resolution(pair, tmp_path):
    """The flag, else on: what the user sets wins, and a drafter config's
    ddtree_default_speculate_sampled is not applied (auto chooses per round, an explicit budget
    drafts every round); the plan then captures decode graphs for the sampled modes at every
    batch size."""
    import json
    import shutil

    from drafttree.config import ModelConfig
    from drafttree.engine.plan import resolve_spec
    from drafttree.models.dflash import DFlashConfig
    t, d = pair
    spec = SpecConfig("ddtree", block_size=8, budget=32, sampled=False)
    assert spec.phases_at(1) == (Phase.DRAFT, Phase.VERIFY) and spec.phases_at(1, greedy=False) == (Phase.DECODE,)
    assert SpecConfig("ddtree", block_size=8, budget=32).phases_at(1, greedy=False) == (Phase.DRAFT, Phase.VERIFY)
    plan = [(e.phase, e.batch_sizes) for e in graph_plan(spec, ModelConfig.from_dir(t), None, 4, [545]) if not e.processed]
    assert plan == [(Phase.CONTEXT, (1, 2, 4)), (Phase.DECODE, (1, 2, 4)), (Phase.DRAFT, (1, 2, 4)),
                    (Phase.VERIFY, (1, 2, 4))]
    off = tmp_path / "off"
    shutil.copytree(d, off)
    cfg = json.loads((off / "config.json").read_text())
    (off / "config.json").write_text(json.dumps({**cfg, "ddtree_default_speculate_sampled": False}))
    for budget in (32, None):
        for path, flag, want in ((d, None, True), (off, None, True), (off, True, True), (d, False, False)):
            ec = EngineConfig(model=str(t), draft_model=str(path), spec="ddtree", budget=budget, speculate_sampled=flag)
            assert resolve_spec(ec, DFlashConfig.from_dir(path)).sampled is want, (budget, path, flag)
    assert "speculate_sampled=on" in describe_plan(EngineConfig(model=str(t), draft_model=str(off), budget=32))
    (off / "config.json").write_text(json.dumps({**cfg, "ddtree_default_speculate_sampled": "no"}))
    with pytest.raises(ValueError, match="ddtree_default_speculate_sampled must be true or false"):
        DFlashConfig.from_dir(off)


def test_plain_rounds_say_why(pair):
    """An explicit budget drafts every round, sampled ones too; plain rounds are counted by their
    reason (a schedule, speculate_sampled off, a request's max_budget)."""
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=4, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=128)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    llm = LLM(**kw)
    llm.generate([[3, 1, 4], [1, 5, 9]], sampled)
    st = llm.engine.stats
    assert set(st.budget_hist) == {4} and not st.plain_rounds
    llm = LLM(**kw, speculate_sampled=False)
    llm.generate([[3, 1, 4]], sampled)
    assert dict(llm.engine.stats.plain_rounds) == {"speculate_sampled off": llm.engine.stats.rounds}
    llm = LLM(**kw, budget_schedule="2:0")
    llm.generate([[3, 1, 4], [1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert set(llm.engine.stats.plain_rounds) == {"budget schedule"}
    llm = LLM(**kw)
    llm.generate([[3, 1, 4]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, max_budget=0))
    assert dict(llm.engine.stats.plain_rounds) == {"max_budget": llm.engine.stats.rounds}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_speculation_off_writes_the_drafter_context_prefill_would(pair, device):
    """Decode rounds with speculation off write the drafter's context in a context phase every
    width(CONTEXT) - 1 steps, not every step; after one more, the drafter's cache holds at every
    position what a prefill of the same tokens writes there (on CUDA: graphed, compiled pieces)."""
    from drafttree.spec_decode.rounds import context_phase
    t, d = pair
    prompt = [3, 1, 4, 1, 5]
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=6, device=device, dtype="float32",
              max_num_seqs=1, max_model_len=128)
    off = LLM(**kw, budget_schedule="1:0")
    r = off.engine.runner
    phases, run_round = [], r.run_round
    r.run_round = lambda B, mode, n, b=None, **kw: phases.append(tuple(st.phase for st in r.round_steps(B, mode, b))) or run_round(B, mode, n, b, **kw)
    out = off.generate([prompt], SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True))[0].token_ids
    C = off.engine.spec.width(Phase.CONTEXT)
    contexts = sum(Phase.CONTEXT in p for p in phases)
    assert len(phases) == len(out) - 1 and all(p[-1] is Phase.DECODE for p in phases)
    assert 1 <= contexts <= len(phases) // (C - 1) + 1 < len(phases), (contexts, len(phases), C)
    assert 1 <= int(r.state.ctx_n[0]) <= r.ctx_bound <= C
    # a fresh pool hands out pages 1, 2, ... in order (in both engines); the finished request's
    # row gave its pages back, so it names them again for the context phase
    table = r.state.block_table
    table[0] = torch.arange(1, table.shape[1] + 1)
    context_phase(r.round_ctx, 1)   # the features still pending: the last ctx_n committed positions
    ref = LLM(**kw)
    ref.generate([prompt + out[:-1]], SamplingParams(temperature=0.0, max_tokens=1))
    n = len(prompt) + len(out) - 1      # every position through the target: all but the last token
    tol = 1e-5 if device == "cpu" else 1e-4   # CUDA: other GEMM kernels for a prefill's rows
    for a, b in ((r.dkv.k, ref.engine.runner.dkv.k), (r.dkv.v, ref.engine.runner.dkv.v)):
        ps = r.kv.page_size
        torch.testing.assert_close(a[:, 0, :, ps:ps + n], b[:, 0, :, ps:ps + n], atol=tol, rtol=tol)
    assert not torch.allclose(r.dkv.k[:, 0, :, ps + n - 1], torch.zeros(()))


def test_rounds_move_across_kv_buckets(pair, fake_cuda_graphs):
    """A request that grows past the 1024-slot bucket switches graphs mid-generation."""
    t, d = pair
    prompt = [(5 * j) % 57 + 1 for j in range(1000)]
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=6, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=1200)
    want = LLM(**kw, cuda_graphs=False).generate([prompt], sp)[0].token_ids
    llm = LLM(**kw, cuda_graphs=True)
    gr = llm.engine.runner.graphs
    assert gr.kv_lengths == [1024, 1200 + llm.engine.spec.kv_headroom]
    replayed = []
    orig = gr.replay
    gr.replay = lambda b, mode, kv_len, steps: replayed.append(kv_len) or orig(b, mode, kv_len, steps)
    assert llm.generate([prompt], sp)[0].token_ids == want
    assert set(replayed) == set(gr.kv_lengths) and gr.fallbacks == 0


def test_shared_graphs_and_graphs_up_to_max_graph_len(pair, fake_cuda_graphs):
    """The drafter's context write is one graph per batch bucket (it writes K/V, attends over nothing),
    its draft one per (batch bucket, KV bucket) (it picks no token), decode and verify one per
    sampler mode as well. With max_graph_len only the KV buckets it reaches are captured: a
    request past them runs those rounds eagerly, counted, to the same tokens."""
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=6, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=1100, prefill_graphs=False)
    gr = LLM(**kw, cuda_graphs=True).engine.runner.graphs
    assert len(gr.kv_lengths) == 2 and len(gr.set_seconds) == 2 * 3 * 2
    for constrained in (False, True):   # the constrained round's steps share as the free round's do
        count = {p: sum(k.phase is p and k.constrained == constrained and not k.processed for k in gr.graphs)
                 for p in (Phase.CONTEXT, Phase.DRAFT, Phase.DECODE, Phase.VERIFY)}
        assert count == {Phase.CONTEXT: 0 if constrained else 2, Phase.DRAFT: 2 * 2, Phase.DECODE: 2 * 3 * 2,
                         Phase.VERIFY: 2 * 3 * 2}
    free = LLM(**kw, cuda_graphs=True, structured_graphs=False).engine.runner.graphs
    assert {k for k in gr.graphs if not k.constrained} == set(free.graphs)
    for g, c in ((gr, True), (free, False)):   # the plan `drafttree graphs` counts from the configs alone
        assert graph_keys(g.rc.spec, 2, g.kv_lengths, g.modes, True, c, True) == set(g.graphs)
    assert {k.kv_len for k in gr.graphs if k.phase is Phase.CONTEXT} == {0}
    capped = LLM(**kw, cuda_graphs=True, max_graph_len=100)
    gr = capped.engine.runner.graphs
    assert gr.kv_lengths == [1024] and {k.kv_len for k in gr.graphs} == {0, 1024}
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[3, 4], [(5 * j) % 57 + 1 for j in range(1010)]]
    want = LLM(**kw, cuda_graphs=False).generate(prompts, sp)
    assert [o.token_ids for o in capped.generate(prompts, sp)] == [o.token_ids for o in want]
    assert gr.fallbacks > 0


@cuda
@pytest.mark.parametrize("spec,budget,schedule", [("none", None, None), ("ddtree", 16, "2:4"), ("ddtree", 16, "2:0"),
                                                   ("dflash", 1, "2:0")])
def test_gpu_kv_buckets_and_schedule_equal_eager(pair, spec, budget, schedule):
    t, d = pair
    prompts = [[(5 * j + i) % 57 + 1 for j in range(1000 - 300 * i)] for i in range(3)]
    sp = [SamplingParams(temperature=0.0 if i else 0.7, seed=i, max_tokens=50, ignore_eos=True) for i in range(3)]
    kw = dict(model=str(t), draft_model=str(d) if spec != "none" else None, spec=spec, budget=budget,
              budget_schedule=schedule, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=1200)
    want = [o.token_ids for o in LLM(**kw, cuda_graphs=False).generate(prompts, sp)]
    llm = LLM(**kw, cuda_graphs=True)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert llm.engine.runner.graphs.fallbacks == 0


@cuda
@pytest.mark.parametrize("spec,budget", [("ddtree", 16), ("dflash", 1)])
def test_gpu_context_phases_write_what_eager_writes(pair, spec, budget):
    """Speculation off: graphed context phases and decode steps give eager's tokens and eager's
    drafter cache."""
    t, d = pair
    prompts = [[(5 * j + i) % 57 + 1 for j in range(40 + 9 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(model=str(t), draft_model=str(d), spec=spec, budget=budget, budget_schedule="1:0", device="cuda",
              dtype="float32", max_num_seqs=4, max_model_len=256)
    eager, graphed = LLM(**kw, cuda_graphs=False), LLM(**kw, cuda_graphs=True)
    pages: dict[int, list[int]] = {}
    free = graphed.engine.scheduler.free

    def keep_pages(seq):   # a finished request's pages, before they go back to the pool
        pages[prompts.index(seq.prompt_ids)] = list(seq.pages)
        free(seq)
    graphed.engine.scheduler.free = keep_pages
    want = [o.token_ids for o in eager.generate(prompts, sp)]
    assert [o.token_ids for o in graphed.generate(prompts, sp)] == want
    assert graphed.engine.runner.graphs.fallbacks == 0
    e, g = eager.engine.runner, graphed.engine.runner
    # both engines schedule alike, so each request held the same pages in both
    ps = e.kv.page_size
    for i, p in enumerate(prompts):   # positions through the target, slot by slot through its pages
        n = len(p) + len(want[i]) - 1
        slots = torch.tensor([pages[i][j // ps] * ps + j % ps for j in range(n)])
        torch.testing.assert_close(g.dkv.k[:, 0, :, slots], e.dkv.k[:, 0, :, slots], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g.dkv.v[:, 0, :, slots], e.dkv.v[:, 0, :, slots], atol=1e-5, rtol=1e-5)


def _graphed_prefill_case(t, d, spec, budget, prefill_chunk=None, **kw):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 59, (n,), generator=g).tolist() for n in (5, 9, 14, 3, 16, 11, 7, 20, 2, 33)]
    sp = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=4 + 3 * i, ignore_eos=True)
          for i in range(len(prompts))]
    # prefix-cache hits on the 33-token prompt's first two pages: the rest (5 and 17 tokens) at
    # position 32, alone and beside a prompt from 0
    prompts += [prompts[9][:32] + [7, 1, 8, 2, 8], prompts[9][:32] + list(range(40, 57)), prompts[4][:5]]
    sp += [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
           SamplingParams(temperature=0.7, seed=11, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    # alone first: (1 prompt, 16 slots) replayed at row 0; then, in a batch of 2, at row 1
    calls = [([0], [0]), ([1, 2, 3] + list(range(4, 10)), [1, 2, 3] + list(range(4, 10))), ([10], [10]),
             ([11, 12], [11, 12])]
    sp[1] = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    kw = dict(model=str(t), draft_model=str(d) if spec != "none" else None, spec=spec, budget=budget,
              dtype="float32", max_num_seqs=2, max_model_len=128, **kw)
    if prefill_chunk is not None:
        kw["prefill_chunk"] = prefill_chunk
    eager = LLM(**kw, cuda_graphs=False)
    want = [[o.token_ids for o in eager.generate([prompts[i] for i in ps], [sp[i] for i in ss])] for ps, ss in calls]
    llm = LLM(**kw, cuda_graphs=True, prefill_graphs=True)
    runner = llm.engine.runner
    pg, runs, eager_runs = runner.prefill_graphs, [], []
    captured = set(pg.graphs)
    assert captured == set(pg.shapes())   # all at start-up
    assert {L for _, _, L in captured} == {0, runner.cache_cfg.max_len}   # one KV bucket at this context
    run, eager_forward = pg._replay, runner._prefill_forward
    pg._replay = lambda ids, start, lens, table, shape: runs.append((int(table[0, 0]), ids.shape[0], shape)) or \
        run(ids, start, lens, table, shape)
    runner._prefill_forward = lambda *a: eager_runs.append(a) or eager_forward(*a)
    got = [[o.token_ids for o in llm.generate([prompts[i] for i in ps], [sp[i] for i in ss])] for ps, ss in calls]
    assert got == want
    assert set(pg.graphs) == captured and pg.fallbacks == 0   # nothing captured while serving
    # every prefill replayed a graph: after a prefix-cache hit and (in chunks of 16: the prompts of
    # 20, 33 and 49 tokens) for a continuing chunk too
    assert not eager_runs and llm.engine.stats.prefix_cache_hits >= 2 * 32
    assert any(L > 0 for _, _, (_, _, L) in runs), runs
    if prefill_chunk is not None:   # batches of 2 prompts over 16 slots went in groups of one
        assert captured == {(1, 16, 0), (1, 16, runner.cache_cfg.max_len)}
        assert len({r for r, _, _ in runs}) >= 2, (runs, list(pg.graphs))
        return
    # graphs were reused for other prompts, and the one-prompt graph over other pages (its first page here)
    assert {n for _, n, _ in runs} == {1, 2} and len({r for r, n, _ in runs if n == 1}) >= 2, (runs, list(pg.graphs))


@pytest.mark.parametrize("spec,budget", [("none", None), ("ddtree", 8), ("dflash", 1)])
def test_graphed_prefill_logic_on_cpu(pair, fake_cuda_graphs, spec, budget):
    """A replay reruns the closure captured at start-up for its (prompts, length bucket) on
    requests' ids, lengths and rows: a value baked in at capture would change tokens."""
    t, d = pair
    _graphed_prefill_case(t, d, spec, budget, device="cpu")


@pytest.mark.parametrize("spec,budget", [("none", None), ("ddtree", 8)])
def test_graphed_prefill_in_groups_on_cpu(pair, fake_cuda_graphs, spec, budget):
    """A batch over the graphed token limit runs as several groups, each replaying a graph at its
    own cache rows; outputs of a group are kept before the next group replays the same graph."""
    t, d = pair
    _graphed_prefill_case(t, d, spec, budget, prefill_chunk=16, device="cpu")


def test_graphed_prefill_under_load_pads_rows_and_captures_nothing_on_cpu(pair, fake_cuda_graphs):
    """Many requests through the scheduler (chunks cut by the step's tokens and by chunks x widest,
    prefix-cache hits, rows refilled as requests end): every forward, from position 0 or at an
    offset, finds a graph captured at start-up, groups of 3 replay the graph of 4 rows (padding
    rows hold the null page only), the tokens are eager prefill's, and serving captures nothing."""
    t, d = pair
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 59, (24,), generator=g).tolist()
    lens = [13, 5, 9, 40, 30, 20, 7, 3, 17, 26, 11, 2, 33, 8]   # 13, 5, 9: one forward, 3 rows of 16
    prompts = [(shared if i % 4 == 3 else []) + torch.randint(1, 59, (n,), generator=g).tolist()
               for i, n in enumerate(lens)]
    sp = [SamplingParams(temperature=0.0 if i % 3 else 0.7, seed=i, max_tokens=3 + i % 5, ignore_eos=True)
          for i in range(len(prompts))]
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=6, max_model_len=128, prefill_chunk=64, max_prefill_tokens=100)
    want = [o.token_ids for o in LLM(**kw, cuda_graphs=False).generate(prompts, sp)]
    llm = LLM(**kw, cuda_graphs=True)
    pg = llm.engine.runner.prefill_graphs
    captured, graphs = set(pg.graphs), len(fake_cuda_graphs)
    assert captured == set(pg.shapes())
    replays, eager_runs = [], []
    run, eager_forward = pg._replay, llm.engine.runner._prefill_forward
    pg._replay = lambda ids, start, lens, table, shape: replays.append((ids.shape[0], shape)) or \
        run(ids, start, lens, table, shape)
    llm.engine.runner._prefill_forward = lambda *a: eager_runs.append(a) or eager_forward(*a)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert any(k < shape[0] for k, shape in replays), replays
    assert not eager_runs and any(shape[2] > 0 for _, shape in replays), replays
    assert pg.fallbacks == 0 and set(pg.graphs) == captured and len(fake_cuda_graphs) == graphs
    assert llm.engine.stats.prefix_cache_hits > 0


def test_prefill_graph_out_of_memory_falls_back_to_eager(pair, fake_cuda_graphs, monkeypatch, caplog):
    """A capture that runs out of memory at start-up costs no request: every prefill runs eagerly,
    after one warning, and gives the tokens eager prefill gives."""
    from drafttree.runner import prefill_graph
    t, d = pair
    prompts = [[3, 5, 7], [(7 * j) % 50 + 1 for j in range(20)], [2, 4, 6, 8, 10]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=1, max_model_len=64)
    want = [o.token_ids for o in LLM(**kw, cuda_graphs=False).generate(prompts, sp)]
    capture, calls = prefill_graph.PrefillGraphs._capture, []

    def capture_once(self, fn):
        calls.append(1)
        if len(calls) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return capture(self, fn)
    monkeypatch.setattr(prefill_graph.PrefillGraphs, "_capture", capture_once)
    llm = LLM(**kw, cuda_graphs=True)
    with caplog.at_level("WARNING"):
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    pg = llm.engine.runner.prefill_graphs
    assert pg.failed and pg.graphs == {} and len(calls) == 2
    assert sum("out of memory capturing a prefill graph" in r.message for r in caplog.records) == 1


def test_graphed_prefill_needs_graphs(pair):
    t, _ = pair
    with pytest.raises(ValueError, match="prefill_graphs needs CUDA graphs"):
        LLM(model=str(t), device="cpu", cuda_graphs=False, prefill_graphs=True)
    assert LLM(model=str(t), device="cpu").engine.runner.prefill_graphs is None   # no graphs on CPU


def test_graphed_prefill_is_on_with_graphs(pair, fake_cuda_graphs):
    t, _ = pair
    kw = dict(model=str(t), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64, cuda_graphs=True)
    assert LLM(**kw).engine.runner.prefill_graphs is not None
    assert LLM(**kw, prefill_graphs=False).engine.runner.prefill_graphs is None


@cuda
@pytest.mark.parametrize("spec,budget,prefill_chunk", [("none", None, None), ("ddtree", 8, None), ("dflash", 1, None),
                                                       ("ddtree", 8, 16)])
def test_gpu_graphed_prefill_equals_eager(pair, spec, budget, prefill_chunk):
    """Real graphs give eager prefill's tokens, from position 0 and at offsets: after prefix-cache
    hits (at one KV bucket, the graph attending over more slots than the eager forward's tight
    length) and, in chunks of 16, for every continuing chunk."""
    t, d = pair
    _graphed_prefill_case(t, d, spec, budget, prefill_chunk=prefill_chunk, device="cuda")


def test_startup_stages_and_warm_up_with_graphs_on_cpu(pair, fake_cuda_graphs):
    """Start-up times each stage (graphs per phase, prefill graphs); the CUDA warm-up plan runs
    through the engine, its prefills graphed from position 0 and at offsets (a chunk continuing a
    prompt, the rest of a prompt after a prefix-cache hit; none here is wider than the graphs),
    with no round or prefill falling back to eager, and leaves the counters at zero and every
    page free."""
    from drafttree.engine.warmup import warm_up
    t, d = pair
    eng = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget=8, budget_schedule="2:0", device="cpu",
              dtype="float32", max_num_seqs=2, max_model_len=64, cuda_graphs=True, prefill_chunk=16).engine
    stages = list(eng.startup.stages)
    assert stages[:4] == ["convert", "load weights", "kv cache", "tokenizer"] and stages[-1] == "prefill graphs", stages
    assert {"graphs warm-up", "graphs draft", "graphs verify", "graphs decode", "graphs context"} <= set(stages)
    pg, r = eng.runner.prefill_graphs, eng.runner
    replays, starts, hits = [], [], []
    run, eager, match = pg._replay, r._prefill_forward, eng.pool.match
    pg._replay = lambda ids, start, lens, table, shape: replays.append((shape, int(start.max()))) or \
        run(ids, start, lens, table, shape)
    r._prefill_forward = lambda ids, start, *a: starts.append(int(start.max())) or eager(ids, start, *a)
    eng.pool.match = lambda ids, limit: hits.append(len(m := match(ids, limit))) or m
    eng.device = torch.device("cuda")   # the CUDA plan: every sample mode, 1 and 2 rows, eager prefill
    try:
        n = warm_up(eng)
    finally:
        eng.device = torch.device("cpu")
    # 3 modes and a processed request x (1 + 2 prompts) (no tokenizer: no constrained one); 17, 18
    # and 32 tokens in chunks of 16, 2 x 17; a 48-token prompt, then 33, 34 and 48 tokens of it
    # again, alone and 33 and 34 together
    assert n == 4 * 3 + 3 + 2 + 1 + 3 + 2
    assert {shape for shape, _ in replays} == set(pg.graphs) and not starts and max(hits) == 2
    assert any(at > 0 for _, at in replays) and all(L > 0 for (_, _, L), at in replays if at > 0)
    assert eng.stats.requests == 0 and eng.stats.generated_tokens == 0 and not eng.runner.timer.totals
    assert pg.fallbacks == 0 and eng.runner.graphs.fallbacks == 0
    assert eng.pool.stats.queries == 0 and eng.scheduler.preemptions == 0 and eng.free_pages == eng.pool.usable


def test_prefill_graphs_left_for_later_are_captured_while_idle_first(pair, fake_cuda_graphs):
    """defer_graphs (the server's): the engine starts with no prefill graph; prefills run eagerly
    meanwhile (not counted as fallbacks) to eager prefill's tokens; `capture_later` captures the
    prefill graphs first, one a call, then the rounds' left for later; afterwards every prefill
    replays a graph and nothing more is captured while serving."""
    from drafttree.engine.engine import Engine, EngineConfig
    t, d = pair
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 59, (n,), generator=g).tolist() for n in (5, 14, 3, 20)]
    sp = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6, ignore_eos=True)
          for i in range(len(prompts))]
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=64)
    want = [o.token_ids for o in LLM(**kw, cuda_graphs=False).generate(prompts, sp)]
    eng = Engine(EngineConfig(**kw, cuda_graphs=True, defer_graphs=True))
    runner = eng.runner
    pg, rg = runner.prefill_graphs, runner.graphs
    shapes, sets, jobs = pg.shapes(), len(rg.pending), len(runner.compile_jobs)
    assert not pg.graphs and pg.pending == shapes and eng.graphs_pending == jobs + len(shapes) + len(rg.upgrade) + sets
    assert f"{len(shapes)} prefill graphs later" in runner.describe_graphs()
    assert run_to_end(eng, prompts, sp) == want
    assert pg.fallbacks == 0 and not pg.graphs
    rounds = len(rg.graphs)
    while runner.compile_jobs:   # the steps to compile come first (`prepare.compiles_later`)
        eng.capture_later()
    assert eng.capture_later() and len(pg.graphs) == 1 and len(rg.graphs) == rounds   # prefill next, one a call
    while pg.pending:
        eng.capture_later()
    assert set(pg.graphs) == set(shapes) and len(rg.pending) == sets
    while eng.capture_later():
        pass
    assert eng.graphs_pending == 0
    replays, eager_runs = [], []
    run, eager_forward = pg._replay, runner._prefill_forward
    pg._replay = lambda ids, start, lens, table, shape: replays.append(shape) or run(ids, start, lens, table, shape)
    runner._prefill_forward = lambda *a: eager_runs.append(a) or eager_forward(*a)
    n = len(fake_cuda_graphs)
    assert run_to_end(eng, prompts, sp) == want
    assert replays and not eager_runs and pg.fallbacks == 0 and len(fake_cuda_graphs) == n
    eng.shutdown()


def test_round_graphs_warm_up_once_after_the_kernels_stage(pair, fake_cuda_graphs, monkeypatch):
    """An engine's start runs every step eagerly first (`warm_kernels`), so each round graph gets
    one eager run before its capture; prefill graphs, whose shapes nothing ran before, two."""
    from drafttree.runner import capture
    t, d = pair
    runs: list[int] = []
    real = capture.warm_up
    monkeypatch.setattr(capture, "warm_up", lambda fn, times=2, reset=None: runs.append(times) or real(fn, times, reset))
    llm = LLM(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=64, cuda_graphs=True)
    rounds, prefills = len(llm.engine.runner.graphs.graphs), len(llm.engine.runner.prefill_graphs.graphs)
    assert rounds and prefills and sorted(runs) == [1] * rounds + [2] * prefills


def test_a_server_engine_compiles_its_pieces_after_start_up_while_idle(pair, fake_cuda_graphs, monkeypatch):
    """defer_graphs on one device, not deterministic: the start runs the pieces as torch ops (no
    Dynamo before /ready), and so do requests' eager paths; while idle the engine runs the steps
    in the compiling settings, then captures every round graph again in them, replacing the
    start's, to the same tokens. Deterministic engines, and those that never compile, do not."""
    from drafttree.engine.engine import Engine
    from drafttree.runner import cuda_graph
    from drafttree.settings import current
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=64, cuda_graphs=True, prefill_graphs=False)
    prompts, sp = [[3, 5, 7, 9], [11, 2, 4]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM(**{**kw, "cuda_graphs": False, "prefill_graphs": None}).generate(prompts, sp)]
    seen: list[tuple[str, str]] = []
    capture = cuda_graph.capture_graph
    monkeypatch.setattr(cuda_graph, "capture_graph",
                        lambda *a, **k: seen.append(("capture", current().compile)) or capture(*a, **k))
    eng = Engine(EngineConfig(**kw, defer_graphs=True))
    runner, rg = eng.runner, eng.runner.graphs
    assert eng.settings.compile == "0" and eng.graph_settings.compile == "1"
    assert {c for _, c in seen} == {"0"} and runner.compile_jobs and rg.upgrade == rg.started
    eager = runner.eager_round
    monkeypatch.setattr(runner, "eager_round", lambda *a: seen.append(("eager", current().compile)) or eager(*a))

    assert run_to_end(eng, prompts, sp) == want
    seen.clear()
    parked = runner._run_parked
    monkeypatch.setattr(runner, "_run_parked", lambda *a: seen.append(("compile", current().compile)) or parked(*a))
    start = dict(rg.graphs)
    free = [k for k in start if not (k.constrained or k.processed)]
    while eng.capture_later():
        pass
    assert eng.graphs_pending == 0 and {c for _, c in seen} == {"1"}
    assert sum(w == "compile" for w, _ in seen) > 0
    assert all(rg.graphs[k] is not start[k] for k in free)   # every graph of the start captured again
    seen.clear()
    assert run_to_end(eng, prompts, sp) == want
    assert rg.fallbacks == 0 and not seen   # replayed: nothing eager, nothing captured on a request's path
    eng.shutdown()
    for other in (dict(deterministic=True), dict(defer_graphs=False)):
        e = Engine(EngineConfig(**{**kw, "defer_graphs": True, **other}))
        assert e.settings is e.graph_settings and not e.runner.compile_jobs and not e.runner.graphs.upgrade
        assert e.runner.graphs.started == e.runner.graphs.sets()   # every set before it serves
        e.shutdown()


def test_a_compile_step_that_fails_while_idle_leaves_the_start_graphs(pair, fake_cuda_graphs, monkeypatch, caplog):
    """A step of the idle compile work that raises (not a compiler's failure, which the pieces turn
    into torch ops themselves) ends that work: said once, the start's graphs kept and replayed, the
    graphs left for later still captured."""
    from drafttree.engine.engine import Engine
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=2, max_model_len=64, cuda_graphs=True, prefill_graphs=False)
    eng = Engine(EngineConfig(**kw, defer_graphs=True))
    runner, rg = eng.runner, eng.runner.graphs
    start = dict(rg.graphs)
    parked = runner._run_parked
    calls = []

    def fail_second(*a):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (test)")
        return parked(*a)
    monkeypatch.setattr(runner, "_run_parked", fail_second)
    with caplog.at_level("ERROR"):
        while eng.capture_later():
            pass
    assert len(calls) == 2 and not runner.compile_jobs and not rg.upgrade and not rg.pending
    assert sum("left for later failed" in r.message for r in caplog.records) == 1
    assert all(rg.graphs[k] is v for k, v in start.items())   # kept, not captured again
    assert any(k.constrained for k in rg.graphs)               # the later sets came in all the same
    eng.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_a_server_engine_serves_from_the_first_sets_until_the_others_are_in(pair, device, request, caplog):
    """defer_graphs, not deterministic: the start captures, at each batch bucket, the most general
    mode at the shortest and the longest KV bucket; every other set is left for while idle (the
    shortest KV buckets and smallest batches first), and its rounds replay those meanwhile — greedy
    and sampled, short and past the first KV bucket — to the tokens of an engine without graphs,
    none eagerly. Once the idle work is done (each kind of it logged once, with its seconds) each
    round replays its own set. On CUDA the graphs are real and the pieces compile while idle."""
    from drafttree.engine.engine import Engine
    from drafttree.runner.cuda_graph import GraphSet
    if device == "cpu":
        request.getfixturevalue("fake_cuda_graphs")
    t, d = pair
    kw = dict(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device=device, dtype="float32",
              max_num_seqs=2, max_model_len=1100, cuda_graphs=True, prefill_graphs=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 59, (n,), generator=g).tolist() for n in (6, 1030, 9)]
    sp = [SamplingParams(temperature=T, seed=i, max_tokens=6, ignore_eos=True) for i, T in enumerate((0.0, 0.0, 0.9))]
    want = [o.token_ids for o in LLM(**{**kw, "cuda_graphs": False, "prefill_graphs": None}).generate(prompts, sp)]
    eng = Engine(EngineConfig(**kw, defer_graphs=True))
    rg = eng.runner.graphs
    top, (short, long) = max(rg.modes), rg.kv_lengths
    assert len(rg.modes) > 1 and short == 1024
    assert set(rg.started) == {GraphSet(B, top, L) for B in (1, 2) for L in (short, long)}
    first = set_keys(eng.spec, first_sets([1, 2], [short, long], rg.modes), True, False, False)
    assert set(rg.graphs) == first   # what `drafttree graphs` counts for such a start
    plan = describe_plan(EngineConfig(**{**kw, "device": "cuda"}, defer_graphs=True))
    assert f"before /ready (defer_graphs): the first sets' {len(first)} round graphs" in plan
    # before /ready the kernels stage ran the first sets' free steps only; the compile steps run every one
    start = len(eng.runner._kernel_steps((top,), [1, 2], False, False))
    assert eng.startup.notes["kernels"].startswith(f"{start} steps run")
    assert len(eng.runner.compile_jobs) == len(eng.runner._kernel_steps(rg.modes, [1, 2], True, True)) > start
    rest = [s for s in rg.pending if s not in rg.started]
    assert set(rest) == set(rg.sets()) - set(rg.started) and rest == sorted(rest, key=lambda s: (s.kv_len, s.batch, s.mode))
    eager = []
    real = eng.runner.eager_round
    eng.runner.eager_round = lambda *a: eager.append(a[:3]) or real(*a)
    assert run_to_end(eng, prompts, sp) == want
    assert rg.stand_ins > 0 and rg.fallbacks == 0 and eng.stats.graph_stand_ins == rg.stand_ins
    assert not [a for a in eager if GraphSet(eng.runner.cache_cfg.batch_bucket(a[0]), a[2], a[1]) not in rg.pending]
    with caplog.at_level("INFO", logger="drafttree.runner.model_runner"):
        while eng.capture_later():
            pass
    said = [r.message for r in caplog.records if r.message.startswith("work left for later:")]
    done = [m for m in said if " done, " in m]
    assert said[0] not in done and "left in all" in said[0]   # how far it is, from its first piece on
    kinds = ("compile steps", "round graphs captured again", "round graphs left for later")
    assert [m.split(":")[1].split(" done")[0].strip() for m in done] == list(kinds)   # each once, in this order
    assert all(eng.runner.idle_work[k][1] > 0 for k in kinds)
    assert not rg.pending and set(s for s in rg.sets()) <= {GraphSet(k.batch, k.mode, k.kv_len) for k in rg.graphs
                                                           if k.mode is not None and k.kv_len}
    used, eager[:] = rg.stand_ins, []
    assert run_to_end(eng, prompts, sp) == want
    assert rg.stand_ins == used and rg.fallbacks == 0 and not eager
    eng.shutdown()


def test_what_a_start_captures_first():
    """Only an engine that leaves graphs for later and is not deterministic captures the first sets
    alone, whether or not a cost table is still to measure (`prepare.cost_model` times it in them)."""
    from types import SimpleNamespace

    from drafttree.engine.prepare import first_sets_only
    from drafttree.sampling import SampleMode as M
    from drafttree.settings import Settings
    modes = (M.GREEDY, M.SAMPLE, M.FILTERED)
    setup = lambda defer, adaptive=True: SimpleNamespace(defer_graphs=defer, sampler_modes=modes,  # noqa: E731
                                                         spec=SimpleNamespace(adaptive=adaptive))
    plain, det = Settings(), Settings(deterministic=True)
    assert not first_sets_only(setup(False), plain) and not first_sets_only(setup(True), det)
    assert first_sets_only(setup(True), plain) and first_sets_only(setup(True, False), plain)
