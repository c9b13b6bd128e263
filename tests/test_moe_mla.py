"""Qwen3-MoE and DeepSeek-V3 (MLA, Kimi K2's architecture) against transformers, and speculative
decoding over them lossless (fp32, CPU): tiny random checkpoints written by save_pretrained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafttree import LLM
from drafttree.config import ModelConfig
from drafttree.loader import fp8_blocks
from drafttree.loader.weights import load_target
from drafttree.models import mla, moe
from drafttree.models.kv_cache import KVLayout, PagedKVCache, attn_meta, causal
from drafttree.models.random_shapes import shape_config
from tests.helpers import check_lossless, greedy, make_prompts, taus_of
from tests.moe_tiny import SHAPES, fp8_copy, make_moe_target, our_logits
from tests.tiny import copy_checkpoint, edit_config, edit_tensors

SHAPE_NAMES = sorted(SHAPES)


@pytest.fixture(scope="module", params=SHAPE_NAMES)
def tiny(request, tmp_path_factory):
    # one shape sharded, so that the index is read too
    shard = "40KB" if request.param == "deepseek_v3" else None
    return request.param, make_moe_target(tmp_path_factory.mktemp(request.param), request.param,
                                          max_shard_size=shard)


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("absorbed,experts", [(True, "gathered"), (False, "all"), (True, "sorted")])
def test_logits_match_transformers(tiny, monkeypatch, absorbed, experts):
    """Whole prompts and prompts fed in chunks through the cache, with MLA absorbed or expanded
    and the experts gathered per (token, k), all run, or sorted by expert (each form must agree)."""
    name, path = tiny
    monkeypatch.setattr(mla, "ABSORBED_MAX_ROWS", 10**6 if absorbed else 0)
    monkeypatch.setattr(moe, "gathers", lambda rows, k, e: experts == "gathered")
    monkeypatch.setattr(moe, "SORTED_MIN_ROWS", 1 if experts == "sorted" else 10**6)
    model, cfg = load_target(path, torch.float32, "cpu")
    assert (cfg.moe is not None) and ((cfg.mla is not None) == name.startswith("deepseek"))
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_model(path)(ids).logits
    assert rel(our_logits(model, cfg, ids, [(0, 37)]), want) < 1e-4, name
    assert rel(our_logits(model, cfg, ids, [(0, 7), (7, 8), (8, 13), (13, 37)]), want) < 1e-4, name


@pytest.mark.parametrize("prompt_len", [1, 9])
def test_greedy_generation_matches_transformers(tiny, prompt_len):
    name, path = tiny
    ref = hf_model(path)
    llm = LLM(model=str(path), spec="none", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=96)
    g = torch.Generator().manual_seed(prompt_len)
    prompts = [torch.randint(0, 97, (prompt_len,), generator=g).tolist() for _ in range(2)]
    for p, out in zip(prompts, llm.generate(prompts, greedy(20))):
        with torch.no_grad():
            x = torch.tensor([p])
            want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                                min_new_tokens=20, pad_token_id=-1)[0, len(p):].tolist()
        assert out.token_ids == want, f"{name} prompt_len={prompt_len}"


def test_drafter_features_are_the_hidden_states(tiny):
    """What a drafter reads (the hidden states after target_layer_ids, as training extracts them)
    is transformers' hidden_states: after layer 0, and after the last layer's final norm."""
    from drafttree.train.forward import FeatureExtractor

    name, path = tiny
    model, cfg = load_target(path, torch.float32, "cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    feats = FeatureExtractor(model, (0, 2), rows=2, max_len=32)(ids)
    with torch.no_grad():
        hs = hf_model(path)(ids, output_hidden_states=True).hidden_states
    D = cfg.hidden_size
    assert rel(feats[..., :D], hs[1]) < 1e-4 and rel(feats[..., D:], hs[3]) < 1e-4, name


def test_mla_cache_holds_the_latent_only(tmp_path):
    """MLA's K pool: one head of kv_lora_rank + qk_rope_head_dim per token; V: no bytes at all.
    The pool's sizing counts that width only."""
    path = make_moe_target(tmp_path, "deepseek_v3")
    cfg = ModelConfig.from_dir(path)
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    layout = KVLayout.of(cfg)
    assert layout == KVLayout(3, 1, width, 0)
    assert layout.bytes_per_token(torch.bfloat16) == 3 * width * 2
    # Kimi K2: a latent of 512 + 64 per token and layer, no V (a dense GQA cache of Qwen3-30B-A3B's
    # shape keeps 2 x 4 heads x 128)
    kimi = KVLayout.of(shape_config("kimi-k2")[0])
    assert kimi == KVLayout(61, 1, 576, 0) and kimi.bytes_per_token(torch.bfloat16) == 61 * 576 * 2
    assert KVLayout.of(shape_config("qwen3-30b-a3b")[0]).bytes_per_token(torch.bfloat16) == 48 * 2 * 4 * 128 * 2
    budget = 3 * width * 4 * 16 * 40   # 40 pages of 16 tokens, fp32
    llm = LLM(model=str(path), spec="none", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=4096,
              kv_cache_memory_gb=budget / 2**30, page_size=16)
    kv = llm.engine.runner.kv
    assert llm.engine.pool.num_pages == 40 and kv.num_pages == 40
    assert kv.k.shape == (3, 1, 1, 40 * 16, width)
    assert kv.v.shape[-1] == 0 and kv.v.numel() == 0 and kv.v.untyped_storage().nbytes() == 0


def test_fp8_block_checkpoint_loads_dequantized(tmp_path):
    """DeepSeek's fp8 format (e4m3, one scale per block, sharded with an index) loads as its
    dequantized weights do, and a scale whose grid does not fit its weight is refused."""
    src = make_moe_target(tmp_path / "src", "deepseek_v3")
    fp8_dir, plain_dir = fp8_copy(src, tmp_path / "fp8", tmp_path / "plain")
    ids = torch.randint(0, 97, (1, 21), generator=torch.Generator().manual_seed(1))
    model, cfg = load_target(fp8_dir, torch.float32, "cpu")
    with torch.no_grad():
        want = hf_model(plain_dir)(ids).logits
    assert rel(our_logits(model, cfg, ids, [(0, 21)]), want) < 1e-4
    w = torch.randn(20, 12).to(torch.float8_e4m3fn)
    assert fp8_blocks.dequantize(w, torch.full((3, 2), 2.0), (8, 8)).equal(w.float() * 2)
    with pytest.raises(ValueError, match="weight_scale_inv of shape"):
        fp8_blocks.dequantize(w, torch.ones(2, 2), (8, 8))


def test_checkpoint_checked_before_loading(tmp_path):
    """A multi-token-prediction layer past num_hidden_layers is never read; a missing expert, or
    a tensor of the wrong shape, is refused by name (checked on meta tensors before any read)."""
    src = make_moe_target(tmp_path / "src", "deepseek_v3")
    extra = {"model.layers.3.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(3, 3)}
    edit_tensors(copy_checkpoint(src, tmp_path / "mtp"), lambda t: {**t, **extra})
    assert load_target(tmp_path / "mtp", torch.float32, "cpu")[0].cfg.num_layers == 3
    edit_tensors(copy_checkpoint(src, tmp_path / "missing"),
                 lambda t: {k: v for k, v in t.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"})
    with pytest.raises(ValueError, match="missing tensor 'layers.2.mlp.experts.3.up_proj.weight'"):
        load_target(tmp_path / "missing", torch.float32, "cpu")
    edit_tensors(copy_checkpoint(src, tmp_path / "shape"),
                 lambda t: {**t, "model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(5, 16)})
    with pytest.raises(ValueError, match="'self_attn.kv_b_proj.weight' has shape"):
        load_target(tmp_path / "shape", torch.float32, "cpu")


def test_expert_forms_agree(monkeypatch):
    """The gathered, all-experts and sorted forms of the same routing give the same output."""
    from drafttree.moe_config import MoEConfig

    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=5, scoring="softmax", norm_topk_prob=True,
                    sparse_layers=(0,))
    ex = moe.Experts(8, cfg)
    torch.nn.init.normal_(ex.gate_up)
    torch.nn.init.normal_(ex.down)
    x = torch.randn(9, 8)
    idx = torch.randint(0, 6, (9, 2))   # repeats too (top-k never picks one twice)
    w = torch.rand(9, 2)
    want = ex.all_experts(x, w, idx)
    assert torch.allclose(ex.gathered(x, w, idx), want, atol=1e-5)
    assert torch.allclose(ex.sorted(x, w, idx), want, atol=1e-5)
    # all experts in groups of 1, 4 (the last group short) and 6: the same sum
    for group in (1, 4, 6):
        monkeypatch.setattr(moe, "ALL_EXPERTS_ELEMENTS", group * 9 * 10)
        assert torch.allclose(ex.all_experts(x, w, idx), want, atol=1e-5), group


def test_config_layers_and_refusals(tiny):
    """Which layers are sparse, moe_layer_freq (DeepSeek's own configs carry it), and rope types."""
    name, path = tiny
    d = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_dict(d)
    want = {"qwen3_moe": (0, 2), "qwen3_moe_yarn": (1,), "deepseek_v3": (1, 2), "deepseek_v3_plain": (0, 1, 2)}
    assert cfg.moe.sparse_layers == want[name]
    if name.startswith("deepseek"):
        assert ModelConfig.from_dict({**d, "num_hidden_layers": 6, "first_k_dense_replace": 1,
                                      "moe_layer_freq": 2}).moe.sparse_layers == (2, 4)
        with pytest.raises(ValueError, match="routing"):
            ModelConfig.from_dict({**d, "topk_method": "group_limited_greedy"})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' for llama"):
        ModelConfig.from_dict({**d, "architectures": ["LlamaForCausalLM"], "intermediate_size": 8,
                               "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


# -- speculative decoding over MoE / MLA targets ---------------------------------------------------

@pytest.mark.parametrize("shape", ["qwen3_moe", "deepseek_v3", "deepseek_v3_plain"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_dflash_matches_plain(moe_zoo, shape, block_size):
    pair = moe_zoo(shape)
    check_lossless(pair, pair.llm("dflash", block_size), make_prompts(pair.vocab), max_tau=block_size)


@pytest.mark.parametrize("shape", ["qwen3_moe", "qwen3_moe_yarn", "deepseek_v3", "deepseek_v3_plain"])
@pytest.mark.parametrize("block_size,budget", [(4, 3), (8, 32), (4, 100)])
def test_ddtree_matches_plain(moe_zoo, shape, block_size, budget):
    """Tree verify (ancestor-only mask, positions start + depth) and compaction of the accepted
    path, through the routed experts and over the latent cache."""
    pair = moe_zoo(shape)
    outs = check_lossless(pair, pair.llm("ddtree", block_size, budget), make_prompts(pair.vocab),
                          max_tau=min(budget, block_size - 1) + 1)
    if budget >= 32:
        assert max(taus_of(outs)) >= 3, "no round accepted 3 tokens: deep paths untested"


def test_ddtree_expanded_prefill_matches_plain(moe_zoo, monkeypatch):
    """MLA expanded for any forward over 8 rows per request (a 30-token prefill, a verify of 33)
    and absorbed below: still plain decoding's tokens."""
    monkeypatch.setattr(mla, "ABSORBED_MAX_ROWS", 8)
    pair = moe_zoo("deepseek_v3")
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", block_size=8, budget=32,
              device="cpu", dtype="float32", max_num_seqs=3, max_model_len=128)
    check_lossless(pair, llm, make_prompts(pair.vocab), max_tau=8)


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=40), "hidden size 40"),
    (dict(vocab_size=50, dflash_config={"mask_token_id": 3}), "vocab size 50"),
    (dict(dflash_config={"target_layer_ids": [0, 3]}), r"target_layer_ids \[3\] not in \[0, 3\)"),
])
def test_drafter_that_does_not_fit_is_refused(moe_zoo, tmp_path, capsys, change, match):
    """By the engine, and by `drafttree graphs` (exit 2, the mismatch named), before any weight loads."""
    from drafttree.cli import main

    pair = moe_zoo("deepseek_v3")
    bad = edit_config(copy_checkpoint(pair.drafter, tmp_path / "bad"), **change)
    with pytest.raises(ValueError, match="drafter does not fit the target: .*" + match):
        LLM(model=str(pair.target), draft_model=str(bad), spec="ddtree", device="cpu", dtype="float32",
            max_num_seqs=1, max_model_len=64)
    capsys.readouterr()
    assert main(["graphs", "--model", str(pair.target), "--draft-model", str(bad), "--spec", "ddtree"]) == 2
    assert "drafter does not fit the target" in capsys.readouterr().err


def test_graphs_shows_the_plan(moe_zoo, capsys):
    from drafttree.cli import main

    pair = moe_zoo("deepseek_v3")
    capsys.readouterr()
    assert main(["graphs", "--model", str(pair.target), "--draft-model", str(pair.drafter), "--spec", "ddtree",
                 "--block-size", "8", "--budget", "20"]) == 0
    out = capsys.readouterr().out
    assert "draft=8, verify=21" in out
    widths = {cols[0]: int(cols[1]) for cols in map(str.split, out.splitlines())
              if len(cols) > 1 and cols[0] in ("draft", "verify")}
    assert widths == {"draft": 8, "verify": 21}


# -- timing shapes ---------------------------------------------------------------------------------

def test_random_shapes_are_the_published_models():
    """On the meta device: Qwen3-30B-A3B's 30.5 B parameters and Kimi K2's 1.03 T (3.3 B and 32.9 B
    of them active per token), and 'name@N' cuts the layers, the drafter then reading layers inside."""
    from drafttree.models.moe_decoder import build_target

    for name, total, active in [("qwen3-30b-a3b", 30.53e9, 3.34e9), ("kimi-k2", 1026.4e9, 32.86e9)]:
        cfg, _ = shape_config(name)
        with torch.device("meta"):
            model = build_target(cfg)
        n = sum(p.numel() for p in model.parameters())
        m = cfg.moe
        idle = len(m.sparse_layers) * (m.num_experts - m.top_k) * 3 * m.intermediate_size * cfg.hidden_size
        assert n == pytest.approx(total, rel=1e-3) and n - idle == pytest.approx(active, rel=1e-2), name
    cfg, d = shape_config("kimi-k2@3")
    assert cfg.num_layers == 3 and cfg.moe.sparse_layers == (1, 2) and max(d["target_layer_ids"]) < 3
    with pytest.raises(ValueError, match="unknown random shape"):
        shape_config("kimi-k3")


def test_bench_phases_on_an_mla_target(moe_zoo, capsys, tmp_path):
    """`python -m drafttree.bench.phases` times a DDTree round of an MLA/MoE target with an
    untrained drafter made for it."""
    from drafttree.bench import phases

    pair = moe_zoo("deepseek_v3")
    out = tmp_path / "phases.json"
    assert phases.main(["--model", str(pair.target), "--random-drafter", "--block-size", "4", "--device", "cpu",
                        "--dtype", "float32", "--spec", "ddtree", "--budget", "8", "--prompt-len", "8",
                        "--max-model-len", "64", "--iters", "1", "--tree-budgets", "", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["widths"] == {"context": 16, "decode": 1, "draft": 4, "verify": 9} and res["eager_ms"]["round"] > 0


@pytest.mark.parametrize("rows,width", [(1, 1), (2, 1), (2, 9), (1, 33)])
def test_decode_and_verify_forwards_have_no_host_sync(tiny, rows, width):
    """A decode (gathered experts at one row), a draft-sized and a verify-sized forward trace
    into one graph (torch.compile fullgraph, eager backend), over the paged pool as the rounds run
    them: no data-dependent shapes, no read-back, so they can be captured. The sorted prefill form,
    which reads its counts back, cannot."""
    name, path = tiny
    model, cfg = load_target(path, torch.float32, "cpu")
    kv = PagedKVCache.allocate(KVLayout.of(cfg), 1 + rows * 16, 4, torch.float32, "cpu")
    table = torch.arange(1, 1 + rows * 16).view(rows, 16)

    def step(ids, pos, meta):
        return model.logits(model(ids, pos, meta, kv.k, kv.v)[0])

    ids = torch.randint(0, cfg.vocab_size, (rows, width), generator=torch.Generator().manual_seed(rows))
    pos = torch.arange(width)[None].expand(rows, width) + 5
    meta = attn_meta(torch.full((rows,), 5), causal(rows, width, "cpu"), 64, block_table=table, page_size=4)
    want = step(ids, pos, meta)   # eager first: the settings are read outside the trace
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="eager", fullgraph=True)(ids, pos, meta), want)
    if (rows, width) == (1, 33):
        x = torch.randn(300, cfg.hidden_size)
        w, idx = torch.rand(300, cfg.moe.top_k), torch.randint(0, cfg.moe.num_experts, (300, cfg.moe.top_k))
        experts = next(m for m in model.modules() if isinstance(m, moe.Experts))
        with pytest.raises(RuntimeError, match="data-dependent"):
            torch.compile(experts.sorted, backend="eager", fullgraph=True)(x, w, idx)
