"""Tensor parallelism over MoE and MLA targets is lossless: at tensor_parallel_size 2 on the CPU
(gloo, fp32) plain decoding, DFlash and DDTree give TP=1's tokens, and DDTree at 4; at 2 and 4 the
sharded forward gives TP=1's logits in every expert form; each rank loads only its share.

Qwen3-MoE: its attention split by KV groups as a dense model's, 8 experts (4 a rank), one dense
layer. DeepSeek-V3: MLA with q-LoRA (its 4 heads split 2 + 2, or 1 a rank), 8 experts in 4
groups keeping 2, a shared expert, the first layer dense; without q-LoRA: every layer sparse, two
shared experts, an o_proj bias (rank 0's alone).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from drafttree.config import ModelConfig
from drafttree.engine.launch import run_ranks
from drafttree.loader.lazy_tensors import CheckpointTensors
from drafttree.loader.weights import load_target
from drafttree.models import mla, moe
from drafttree.models.kv_cache import KVLayout, PagedKVCache, attn_meta, causal
from drafttree.moe_config import MoEConfig
from drafttree.parallel import comm
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import expert_span, kv_span, q_span, valid_sizes
from tests.helpers import interpreted_on_cpu, make_prompts, requires_triton
from tests.moe_tiny import fp8_copy, make_moe_target, paged_logits
from tests.tp_helpers import fake_group, mixed, sharded

FORMS = ("gathered", "all", "sorted")


@pytest.mark.parametrize("shape,spec,world", [
    ("qwen3_moe", "none", 2), ("qwen3_moe", "dflash", 2), ("qwen3_moe", "ddtree", 2),
    ("deepseek_v3", "none", 2), ("deepseek_v3", "dflash", 2), ("deepseek_v3", "ddtree", 2),
    ("deepseek_v3_plain", "ddtree", 2), ("deepseek_v3", "ddtree", 4),   # at 4: a head and 2 experts a rank
])
def test_sharded_moe_gives_tp1_tokens(moe_zoo, shape, spec, world):
    pair = moe_zoo(shape)
    prompts = make_prompts(pair.vocab)
    want = pair.llm(spec).generate(prompts, mixed())
    with sharded(pair, spec, world) as llm:
        assert llm.engine.world == world
        k = llm.engine.runner.kv.k   # rank 0's pool: its KV heads, or MLA's whole latent
        if shape.startswith("deepseek"):
            assert k.shape[2] == 1 and k.shape[-1] == llm.engine.model_cfg.head_dim and llm.engine.runner.kv.v.numel() == 0
        else:
            assert k.shape[2] == 1   # 1 of 2 KV heads
        got = llm.generate(prompts, mixed())
        assert llm.engine.agree()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.metrics["accept_lengths"] == w.metrics["accept_lengths"]
    if spec != "none":
        assert max(t for o in got for t in o.metrics["accept_lengths"]) > 1   # speculation really accepted


# -- the sharded forward --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("tp-moe")
    return [make_moe_target(root / "qwen3_moe", "qwen3_moe"), make_moe_target(root / "deepseek_v3", "deepseek_v3"),
            make_moe_target(root / "deepseek_v3_bias", "deepseek_v3_plain", attention_bias=True)]


@contextlib.contextmanager
def expert_form(form: str) -> Iterator[None]:
    """Every forward's experts gathered per pair, all run, or sorted by expert; MLA absorbed, or
    expanded with all experts."""
    saved = moe.gathers, moe.SORTED_MIN_ROWS, mla.ABSORBED_MAX_ROWS
    moe.gathers = lambda rows, k, e: form == "gathered"
    moe.SORTED_MIN_ROWS = 1 if form == "sorted" else 10**6
    mla.ABSORBED_MAX_ROWS = 0 if form == "all" else 10**6
    try:
        yield
    finally:
        moe.gathers, moe.SORTED_MIN_ROWS, mla.ABSORBED_MAX_ROWS = saved


def decode_collectives(model, cfg) -> Counter:
    """The collectives of a one-token forward."""
    kv = PagedKVCache.allocate(model.kv_layout, 2, 4, torch.float32, "cpu")
    meta = attn_meta(torch.zeros(1, dtype=torch.long), causal(1, 1, "cpu"), 1, block_table=torch.ones(1, 1, dtype=torch.long),
                     page_size=4)
    with comm.recording() as ops, torch.no_grad():
        model.logits(model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), meta, kv.k, kv.v)[0])
    return Counter(op for op, _, _ in ops)


def _sharded_run(tp: TPGroup, paths: list[Path]) -> dict:
    """On every rank: each model's logits in each expert form, its layout and a decode's collectives."""
    torch.set_num_threads(1)
    out = {}
    for path in paths:
        model, cfg = load_target(path, torch.float32, "cpu", tp)
        for form in FORMS:
            with expert_form(form):
                out[path.name, form] = paged_logits(model, cfg)
        out[path.name, "layout"] = model.kv_layout
        out[path.name, "collectives"] = decode_collectives(model, cfg)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_logits_match_tp1(models, world):
    """Each expert form (and MLA absorbed and expanded) over `world` ranks gives TP=1's logits
    within fp32 rounding (the ranks' parts are summed in another order), TP=1's are transformers';
    a decode runs one all-reduce per attention and per MLP or MoE block (routed and shared experts
    together), one after the embedding, and one gather of the logits; MLA's pool keeps the whole
    latent on every rank. At 4 ranks: 2 experts and 1 query head a rank (Qwen3-MoE's 2 KV heads
    replicated), the models that take 4."""
    from transformers import AutoModelForCausalLM

    paths = [p for p in models if world in valid_sizes(ModelConfig.from_dir(p))]
    assert len(paths) == (3 if world == 2 else 2)
    got = run_ranks(_sharded_run, world, "cpu", 120.0, paths)
    for path in paths:
        model, cfg = load_target(path, torch.float32, "cpu")
        for form in FORMS:
            with expert_form(form):
                want = paged_logits(model, cfg)
            assert float((got[path.name, form] - want).norm() / want.norm()) < 1e-5, (path.name, form)
        ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
        assert float((want - hf).norm() / hf.norm()) < 1e-4, path.name
        assert got[path.name, "collectives"] == {"all_reduce": 1 + 2 * cfg.num_layers, "all_gather": 1}
        assert got[path.name, "layout"] == (KVLayout(3, 1, cfg.head_dim, 0) if cfg.mla else KVLayout(3, 1, 16, 16))


# -- shards (no processes) ------------------------------------------------------------------------

def expected_shard(name: str, whole: torch.Tensor, cfg, rank: int, world: int) -> torch.Tensor | None:
    """What rank `rank` should hold of a TP=1 parameter (None: nothing), written out per weight."""
    D, every = cfg.hidden_size, slice(None)

    def split(n: int) -> slice:
        return slice(rank * n // world, (rank + 1) * n // world)

    first, h = q_span(cfg, world, rank)
    heads = slice(first, first + h)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = -(-cfg.vocab_size // world)
        part = whole[rank * rows:(rank + 1) * rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], D)])
    if name.endswith(("experts.gate_up", "experts.down")):
        return whole[split(cfg.moe.num_experts)]
    if name.endswith("gate_up_proj.weight"):   # a dense MLP's or the shared experts' [gate; up]
        return whole.view(2, -1, D)[:, split(whole.shape[0] // 2)].reshape(-1, D)
    if name.endswith("down_proj.weight"):
        return whole[:, split(whole.shape[1])]
    if cfg.mla is not None:
        m = cfg.mla
        if name.endswith(("q_proj.weight", "q_b_proj.weight")):
            return whole.view(cfg.num_heads, -1, whole.shape[1])[heads].reshape(-1, whole.shape[1])
        if name.endswith("kv_b_proj.weight"):
            return whole.view(cfg.num_heads, -1, m.kv_lora_rank)[heads].reshape(-1, m.kv_lora_rank)
        if name.endswith("o_proj.weight"):
            return whole.view(D, cfg.num_heads, m.v_head_dim)[:, heads].reshape(D, -1)
        if name.endswith("o_proj.bias"):
            return whole if rank == 0 else None
    elif name.endswith("qkv_proj.weight"):
        hd, H, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q, k, v = whole.split([H * hd, kv * hd, kv * hd])
        a, n = kv_span(kv, world, rank)
        return torch.cat([q[first * hd:(first + h) * hd], k[a * hd:(a + n) * hd], v[a * hd:(a + n) * hd]])
    elif name.endswith("o_proj.weight"):
        return whole[:, first * cfg.head_dim:(first + h) * cfg.head_dim]
    return whole[every]   # routers, norms, MLA's latent projections: whole


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_and_holds_its_share(models, tmp_path_factory, monkeypatch, world):
    """Every parameter a rank holds is its slice of TP=1's (written out per weight above), the
    routed experts a contiguous run of E/N; no other rank's expert is read from the checkpoint;
    and a DeepSeek fp8 checkpoint's slices, whose edges need not fall on its 8 x 8 blocks at 4
    ranks (kv_b_proj's 20 rows a head), dequantize to the same values."""
    fp8 = tmp_path_factory.mktemp("fp8")
    fp8_dir, _ = fp8_copy(models[1], fp8 / "fp8", fp8 / "plain")
    reads: list[str] = []
    read = CheckpointTensors._read
    monkeypatch.setattr(CheckpointTensors, "_read", lambda self, name, part=None: reads.append(name) or read(self, name, part))
    for path in [*models, fp8_dir]:
        whole_model, cfg = load_target(path, torch.float32, "cpu")
        if world not in valid_sizes(cfg):   # DeepSeek without q-LoRA: 2 heads, 6 experts
            continue
        whole = dict(whole_model.named_parameters())
        first_experts = []
        for rank in range(world):
            reads.clear()
            model, _ = load_target(path, torch.float32, "cpu", fake_group(rank, world))
            mine = dict(model.named_parameters())
            for name, w in whole.items():
                want = expected_shard(name, w, cfg, rank, world)
                if want is None:
                    assert name not in mine, name
                else:
                    assert torch.equal(mine[name], want), (path.name, rank, name)
            first, n = expert_span(cfg.moe.num_experts, world, rank)
            first_experts.append(first)
            experts_read = {int(r.split(".")[4]) for r in reads if ".mlp.experts." in r}
            assert experts_read == set(range(first, first + n)), (path.name, rank, experts_read)
        assert first_experts == [r * cfg.moe.num_experts // world for r in range(world)]


def expert_shards(world: int) -> tuple[moe.Experts, list[moe.Experts], tuple[torch.Tensor, ...]]:
    """8 random experts whole and over `world` ranks, and (x, w, idx) of 9 tokens at top-3."""
    cfg = MoEConfig(num_experts=8, top_k=3, intermediate_size=5, scoring="softmax", norm_topk_prob=True,
                    sparse_layers=(0,))
    g = torch.Generator().manual_seed(world)
    whole = moe.Experts(6, cfg).requires_grad_(False)
    whole.gate_up.copy_(torch.randn(whole.gate_up.shape, generator=g))
    whole.down.copy_(torch.randn(whole.down.shape, generator=g))
    ranks = []
    for r in range(world):
        ex = moe.Experts(6, cfg, fake_group(r, world)).requires_grad_(False)
        n = 8 // world
        ex.gate_up.copy_(whole.gate_up[r * n:(r + 1) * n])
        ex.down.copy_(whole.down[r * n:(r + 1) * n])
        ranks.append(ex)
    x = torch.randn(9, 6, generator=g)
    idx = torch.rand(9, 8, generator=g).topk(3, dim=-1).indices
    return whole, ranks, (x, torch.rand(9, 3, generator=g), idx)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_shards_sum_to_the_whole(world):
    """Each rank's experts over every pair, the others' pairs weighing zero, sum over the ranks to
    the whole block's output in every torch form; the graph-captured forms stay free of host syncs
    (one graph under torch.compile's fullgraph)."""
    whole, ranks, (x, w, idx) = expert_shards(world)
    for form in ("gathered", "all_experts", "sorted"):
        want = getattr(whole, form)(x, w, idx)
        got = sum(getattr(ex, form)(x, *ex.local(w, idx)) for ex in ranks)
        assert torch.allclose(got, want, atol=1e-5), form
    ex = ranks[-1]
    for form in ("gathered", "all_experts"):
        torch._dynamo.reset()
        run = torch.compile(lambda x, w, idx: getattr(ex, form)(x, *ex.local(w, idx)), backend="eager",
                            fullgraph=True)
        assert torch.equal(run(x, w, idx), getattr(ex, form)(x, *ex.local(w, idx))), form


@requires_triton
def test_grouped_expert_shards_sum_to_the_whole(monkeypatch):
    """The grouped GEMMs (Triton's interpreter on the CPU) over each rank's experts: the layout
    takes the others' pairs at weight zero, and the ranks sum to the whole."""
    interpreted_on_cpu(monkeypatch)
    whole, ranks, (x, w, idx) = expert_shards(2)
    got = sum(ex.grouped(x, *ex.local(w, idx)) for ex in ranks)
    assert torch.allclose(got, whole.all_experts(x, w, idx), atol=1e-5)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b@2", "kimi-k2@2"])
def test_random_shapes_build_each_ranks_share(shape):
    """On the meta device at 8 ranks: E/8 experts a rank, MLA's H/8 heads; only the router, the
    norms and MLA's latent projections whole."""
    from drafttree.models.moe_decoder import build_target
    from drafttree.models.random_shapes import shape_config

    cfg, world = shape_config(shape)[0], 8
    with torch.device("meta"):
        whole = dict(build_target(cfg).named_parameters())
        ranks = [dict(build_target(cfg, fake_group(r, world)).named_parameters()) for r in range(world)]
    assert all(r.keys() == whole.keys() for r in ranks)
    kept = {n.split(".")[-2] for n, p in whole.items() if all(r[n].shape == p.shape for r in ranks)}
    assert kept <= {"input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm", "router",
                    "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"}, kept
    layer = cfg.moe.sparse_layers[0]
    assert ranks[3][f"layers.{layer}.mlp.experts.gate_up"].shape[0] == cfg.moe.num_experts // world
    if cfg.mla is not None:
        m = cfg.mla
        assert ranks[3][f"layers.{layer}.self_attn.q_b_proj.weight"].shape[0] == \
            cfg.num_heads // world * (m.qk_nope_head_dim + m.qk_rope_head_dim)


def test_random_weights_held_whole_are_the_same_on_every_rank(models):
    """A random-weight target's router and latent projections, drawn on each rank, agree."""
    from drafttree.models.random_shapes import random_model

    cfg = ModelConfig.from_dir(models[1])
    a, b = (dict(random_model(cfg, torch.device("cpu"), torch.float32, fake_group(r, 2)).named_parameters())
            for r in range(2))
    for name in ("layers.1.mlp.router.weight", "layers.1.self_attn.q_a_proj.weight",
                 "layers.1.self_attn.kv_a_proj_with_mqa.weight"):
        assert torch.equal(a[name], b[name]), name
