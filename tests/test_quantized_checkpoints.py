"""Quantized checkpoints load as stored and stay so on the device: compressed-tensors int4
`pack-quantized` laid out as Kimi K2.6's (routed experts int4, the rest bf16, the config's `ignore`
with exact names and `re:` patterns) and DeepSeek's fp8 blocks, over tiny random DeepSeek-V3 and
Qwen3-MoE checkpoints (fp32, CPU). The loaded model equals transformers on the same weights
dequantized; plain, DFlash and DDTree decoding give the same tokens, at TP=1 and TP=2; the
experts' bytes are the stored bytes; unsupported forms are refused before any weight is read.

The int4 files are packed here, independently of the loader's code: q = round(w / s) in [-8, 7]
per group of G inputs with s = absmax / 7 (bf16), q + 8 in 4 bits, 8 a little-endian int32 word.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafttree.config import ModelConfig
from drafttree.engine.launch import run_ranks
from drafttree.kernels.fp8_block_ops import dequantize
from drafttree.loader import quantization
from drafttree.loader.lazy_tensors import CheckpointTensors
from drafttree.loader.weights import load_target
from drafttree.models import moe
from drafttree.models.kv_cache import KVLayout, PagedKVCache, attn_meta, causal
from drafttree.models.quant_experts import Fp8BlockExperts, Int4Experts
from drafttree.models.quant_linear import Fp8BlockLinear, Int4Linear
from drafttree.models.random_shapes import parse_shape, random_model, random_target, shape_config
from tests.helpers import Pair, check_lossless, greedy, make_prompts
from tests.moe_tiny import fp8_copy, make_moe_target, our_logits, paged_logits
from tests.tp_helpers import fake_group, mixed, sharded
from tests.tiny import copy_checkpoint, edit_config, make_drafter

VOCAB = 11
# Kimi-K2-Thinking's (and K2.5's, K2.6's) ignore list: attention, shared experts, the dense MLP
# and the LM head stay bf16; the routed experts are int4
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
# Qwen3-MoE: everything Linear but the router, the LM head and one exact name; the last pattern
# never matches (names begin 'model.', and `re:` matches from the start, as compressed-tensors does)
QWEN_IGNORE = ["lm_head", r"re:.*mlp\.gate$", "model.layers.0.self_attn.o_proj", r"re:layers\.1\..*"]


def int4_config(group: int, ignore: list[str], targets: tuple[str, ...] = ("Linear",)) -> dict:
    """A quantization_config laid out field for field as Kimi-K2-Thinking's config.json."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"}
    return {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                          "targets": list(targets), "weights": weights}},
            "format": "pack-quantized", "ignore": ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def pack_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight_packed int32 [N, K / 8], weight_scale bf16 [N, K / G], the weight they mean in fp32)."""
    N, K = w.shape
    g = w.view(N, K // group, group)
    scale = (g.abs().amax(dim=-1) / 7).clamp(min=1e-4).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7)
    u = (q.view(N, K).long() + 8).view(N, K // 8, 8)
    words = sum(u[..., i] << (4 * i) for i in range(8))
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return packed, scale, (q * scale.float()[..., None]).view(N, K)


def int4_copy(src: Path, out: Path, plain: Path, quantized, group: int, ignore: list[str]) -> tuple[Path, Path]:
    """`out`: src's Linear weights whose module `quantized(module)` names packed as int4 (two shards
    and an index, as the published checkpoints); `plain`: the same weights dequantized."""
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    packed, dense = {}, {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and quantized(module)):
            packed[name] = dense[name] = w
            continue
        packed[module + ".weight_packed"], packed[module + ".weight_scale"], dense[name] = pack_int4(w, group)
        packed[module + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
    for d in (out, plain):
        d.mkdir(parents=True, exist_ok=True)
    (plain / "config.json").write_text(json.dumps(cfg))
    save_file(dense, str(plain / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": int4_config(group, ignore)}))
    names = sorted(packed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, part in shards.items():
        save_file({n: packed[n] for n in part}, str(out / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out, plain


def kimi_experts(module: str) -> bool:
    return ".mlp.experts." in module


def qwen_linears(module: str) -> bool:
    return module.endswith("_proj") and module != "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (quantized checkpoint, the same weights dequantized), each with a drafter beside it."""
    root = tmp_path_factory.mktemp("quantized")
    ds = make_moe_target(root / "ds", "deepseek_v3", vocab=VOCAB, scale=3.0)
    qw = make_moe_target(root / "qw", "qwen3_moe", vocab=VOCAB, scale=3.0)
    out = {
        "kimi-int4": int4_copy(ds, root / "kimi-int4", root / "kimi-plain", kimi_experts, 16, KIMI_IGNORE),
        "qwen-int4": int4_copy(qw, root / "qwen-int4", root / "qwen-plain", qwen_linears, 8, QWEN_IGNORE),
        # the dense MLP bf16 too, so that TP=2 cuts every int4 input dim on a group
        "qwen-int4-tp": int4_copy(qw, root / "qwen-int4-tp", root / "qwen-tp-plain",
                                  lambda m: qwen_linears(m) and ".layers.1.mlp." not in m, 8,
                                  QWEN_IGNORE + [r"re:.*layers\.1\.mlp\..*"]),
        "ds-fp8": fp8_copy(ds, root / "ds-fp8", root / "ds-fp8-plain"),
    }
    for path, _ in out.values():
        make_drafter(path.parent / (path.name + "-drafter"), path, block_size=4, target_layer_ids=[0, 2])
    return out


_PAIRS: dict[Path, Pair] = {}


def pair(ckpts, name: str, dequantized: bool = False) -> Pair:
    """The checkpoint (or its dequantized copy) with its drafter, engines cached across tests."""
    path = ckpts[name][1 if dequantized else 0]
    if path not in _PAIRS:
        _PAIRS[path] = Pair(path, ckpts[name][0].parent / (ckpts[name][0].name + "-drafter"), VOCAB)
    return _PAIRS[path]


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# -- the config ----------------------------------------------------------------------------------

def test_int4_config_covers_what_compressed_tensors_covers():
    q = quantization.parse({"quantization_config": int4_config(32, KIMI_IGNORE)})
    assert q.method == "int4" and q.describe() == "int4 pack-quantized in groups of 32"
    covered = {"model.layers.3.mlp.experts.7.gate_proj": 32, "model.layers.3.mlp.experts.0.down_proj": 32,
               "model.layers.3.self_attn.q_b_proj": None, "model.layers.3.self_attn.kv_b_proj": None,
               "model.layers.3.mlp.shared_experts.up_proj": None, "model.layers.0.mlp.gate_proj": None,
               "model.layers.0.mlp.down_proj": None, "lm_head": None,
               "model.layers.3.mlp.gate": None}   # the router is not a Linear module
    assert {m: q.group_size(m) for m in covered} == covered
    q = quantization.parse({"quantization_config": int4_config(8, QWEN_IGNORE)})
    assert q.group_size("model.layers.0.self_attn.o_proj") is None      # an exact name
    assert q.group_size("model.layers.1.self_attn.o_proj") == 8         # the exact name only
    assert q.group_size("model.layers.1.mlp.experts.2.up_proj") == 8    # 're:layers\.1\..*' matches from the start
    named = quantization.parse({"quantization_config": int4_config(8, [], targets=(r"re:.*experts\.\d+\.down_proj$",))})
    assert named.group_size("model.layers.1.mlp.experts.2.down_proj") == 8
    assert named.group_size("model.layers.1.mlp.experts.2.gate_proj") is None
    fp8 = quantization.parse({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    assert fp8.method == "fp8" and fp8.block == (128, 128)
    assert quantization.parse({"architectures": ["Qwen3MoeForCausalLM"]}) is None


def weights_of(**changes) -> dict:
    base = int4_config(32, KIMI_IGNORE)
    base["config_groups"]["group_0"]["weights"].update(changes)
    return base


UNSUPPORTED = [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({**int4_config(32, []), "format": "float-quantized"}, "format 'float-quantized'"),
    ({**int4_config(32, []), "format": "marlin-24"}, "format 'marlin-24'"),
    (weights_of(num_bits=8), "8-bit int weights"),
    (weights_of(type="float"), "4-bit float weights"),
    (weights_of(symmetric=False), "asymmetric"),
    (weights_of(strategy="channel", group_size=None), "strategy 'channel'"),
    (weights_of(actorder="group"), "actorder 'group'"),
    ({**int4_config(32, []), "config_groups": {"group_0": {**int4_config(32, [])["config_groups"]["group_0"],
      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     "input_activations \\(8-bit float\\)"),
    ({**int4_config(32, []), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 without weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'static'"),
]


@pytest.mark.parametrize("qcfg,found", UNSUPPORTED)
def test_unsupported_forms_are_refused_before_any_weight_is_read(ckpts, tmp_path, monkeypatch, qcfg, found):
    """The message names the form found and lists what loads; nothing of the checkpoint is read."""
    bad = copy_checkpoint(ckpts["kimi-int4"][0], tmp_path / "bad")
    edit_config(bad, quantization_config=None)
    edit_config(bad, quantization_config=qcfg)
    monkeypatch.setattr(CheckpointTensors, "__init__", lambda *a, **k: pytest.fail("the checkpoint was opened"))
    with pytest.raises(ValueError, match=f"unsupported checkpoint quantization: .*{found}.*drafttree loads "
                                         "compressed-tensors 'pack-quantized' int4"):
        load_target(bad, torch.float32, "cpu")


@pytest.mark.parametrize("change,match", [
    (dict(ignore=KIMI_IGNORE[:2] + KIMI_IGNORE[3:]),   # shared experts covered, stored bf16
     r"covers 'model.layers.1.mlp.shared_experts.gate_proj', but the checkpoint stores .* unquantized"),
    (dict(ignore=KIMI_IGNORE + [r"re:.*experts\.3\..*"]),   # expert 3 left out, stored int4
     r"stores 'model.layers.1.mlp.experts.3.gate_proj' as int4 .* leave it unquantized"),
    (dict(config_groups={"group_0": {**int4_config(8, [])["config_groups"]["group_0"]}}),
     r"'model.layers.1.mlp.experts.0.gate_proj' is stored in int4 groups of 16; its quantization_config says 8"),
    (None, r"stores quantized weights .* but its config.json has no quantization_config"),
])
def test_checkpoints_that_disagree_with_their_config_are_refused(ckpts, tmp_path, monkeypatch, change, match):
    """A module the config covers but the checkpoint stores otherwise (or the reverse), a group size
    the scales contradict, packed tensors without a config: refused by name, nothing read."""
    bad = copy_checkpoint(ckpts["kimi-int4"][0], tmp_path / "bad")
    if change is None:
        edit_config(bad, quantization_config=None)
    else:
        edit_config(bad, quantization_config=change)
    monkeypatch.setattr(CheckpointTensors, "_read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(ValueError, match=match):
        load_target(bad, torch.float32, "cpu")


def test_quantized_dense_checkpoint_is_refused(tmp_path, monkeypatch):
    """Dense targets load 16- or 32-bit checkpoints only: a quantized one is refused, not misread."""
    from tests.tiny import make_target

    path = edit_config(make_target(tmp_path / "dense", "qwen3", vocab=VOCAB), quantization_config=int4_config(8, []))
    monkeypatch.setattr("drafttree.loader.weights.read_safetensors", lambda *a: pytest.fail("the weights were read"))
    with pytest.raises(ValueError, match=r"quantized checkpoints \(int4 pack-quantized in groups of 8\) load for the "
                                         "MoE and MLA targets .* a dense qwen3 model"):
        load_target(path, torch.float32, "cpu")


# -- loading, against transformers -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["kimi-int4", "qwen-int4", "ds-fp8"])
def test_loads_as_stored_and_matches_transformers(ckpts, monkeypatch, name):
    """Each quantized module holds the stored tensors (kv_b_proj, used as a matrix, widened); the
    logits, whole and fed in chunks, are transformers' on the dequantized weights with the experts
    in each form: the dispatch entry (gathered per pair), every expert widened in groups (of one
    expert too), sorted by expert."""
    path, plain = ckpts[name]
    model, cfg = load_target(path, torch.float32, "cpu")
    layer = model.layers[1]
    if name == "kimi-int4":
        assert isinstance(layer.mlp.experts, Int4Experts) and layer.mlp.experts.gate_up.dtype == torch.int32
        assert type(layer.self_attn.q_b_proj) is type(layer.mlp.shared.down_proj) is torch.nn.Linear
        assert type(model.layers[0].mlp.gate_up_proj) is torch.nn.Linear
    elif name == "qwen-int4":
        assert isinstance(layer.mlp.gate_up_proj, Int4Linear)                # layer 1: the dense MLP
        assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.self_attn.o_proj, Int4Linear)
        assert type(model.layers[0].self_attn.o_proj) is torch.nn.Linear     # ignored by exact name
        assert isinstance(model.layers[0].mlp.experts, Int4Experts)
        assert model.layers[0].mlp.router.weight.dtype == torch.float32
    else:
        assert isinstance(layer.mlp.experts, Fp8BlockExperts) and layer.mlp.experts.gate_up.dtype == torch.float8_e4m3fn
        for m in (layer.self_attn.q_a_proj, layer.self_attn.q_b_proj, layer.self_attn.o_proj,
                  layer.mlp.shared.gate_up_proj, model.layers[0].mlp.down_proj):
            assert isinstance(m, Fp8BlockLinear), m
    if cfg.mla is not None:
        assert type(layer.self_attn.kv_b_proj) is torch.nn.Linear
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    want = hf_logits(plain, ids)
    for form in ("gathered", "all", "all-by-one", "sorted"):
        monkeypatch.setattr(moe, "gathers", lambda rows, k, e: form == "gathered")
        monkeypatch.setattr(moe, "SORTED_MIN_ROWS", 1 if form == "sorted" else 10**6)
        monkeypatch.setattr(moe, "ALL_EXPERTS_ELEMENTS", 1 if form == "all-by-one" else 1 << 26)
        assert rel(our_logits(model, cfg, ids, [(0, 37)]), want) < 1e-4, (name, form)
        assert rel(our_logits(model, cfg, ids, [(0, 7), (7, 8), (8, 13), (13, 37)]), want) < 1e-4, (name, form)


def test_expert_bytes_are_the_stored_bytes(ckpts):
    """A loaded layer's routed experts hold exactly the bytes the checkpoint stores for them (int4
    words and bf16 scales; e4m3 and fp32 scales), not bf16's; Kimi K2's layer, from its shape."""
    for name in ("kimi-int4", "ds-fp8"):
        path, _ = ckpts[name]
        model, cfg = load_target(path, torch.float32, "cpu")
        stored = {}
        for f in path.glob("*.safetensors"):
            stored.update(load_file(str(f)))
        m = cfg.moe
        for i in m.sparse_layers:
            ex = model.layers[i].mlp.experts
            held = sum(b.nbytes for b in ex.buffers())
            files = sum(t.nbytes for k, t in stored.items()
                        if f"layers.{i}.mlp.experts." in k and "weight_shape" not in k)
            assert held == files, (name, i)
            assert held < m.num_experts * 3 * m.intermediate_size * cfg.hidden_size * 2 * 0.75
    # Kimi K2 (K2.6's int4 experts in groups of 32): 384 experts of 3 x 2048 x 7168, 4 bits and a
    # bf16 scale per 32 values: 9.51 GB a layer (33.8 GB in bf16); 1.19 GB on each of 8 ranks
    cfg = shape_config("kimi-k2")[0]
    m = cfg.moe
    per_expert = 3 * m.intermediate_size * cfg.hidden_size // 2 + 3 * m.intermediate_size * cfg.hidden_size // 32 * 2
    assert per_expert == 24_772_608
    for world, want in ((1, 9_512_681_472), (8, 1_189_085_184)):
        with torch.device("meta"):
            ex = Int4Experts(cfg.hidden_size, m, fake_group(world - 1, world) if world > 1 else None, 32)
        assert sum(b.nbytes for b in ex.buffers()) == want == m.num_experts // world * per_expert


def test_verify_forward_has_no_host_sync(ckpts):
    """A verify-sized forward over int4 (and fp8) weights, routed experts and projections, traces
    into one graph (torch.compile fullgraph, eager backend): it can be captured."""
    for name in ("qwen-int4", "ds-fp8"):
        model, cfg = load_target(ckpts[name][0], torch.float32, "cpu")
        kv = PagedKVCache.allocate(KVLayout.of(cfg), 1 + 2 * 16, 4, torch.float32, "cpu")

        def step(ids, pos, meta):
            return model.logits(model(ids, pos, meta, kv.k, kv.v)[0])

        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
        meta = attn_meta(torch.full((2,), 5), causal(2, 9, "cpu"), 64,
                         block_table=torch.arange(1, 33).view(2, 16), page_size=4)
        pos = torch.arange(9)[None].expand(2, 9) + 5
        want = step(ids, pos, meta)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(step, backend="eager", fullgraph=True)(ids, pos, meta), want), name


# -- decoding --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,spec", [("kimi-int4", "dflash"), ("kimi-int4", "ddtree"), ("qwen-int4", "ddtree"),
                                       ("ds-fp8", "ddtree")])
def test_speculative_decoding_is_lossless(ckpts, name, spec):
    """Plain decoding of the quantized checkpoint gives the dequantized one's tokens; DFlash and
    DDTree give plain decoding's."""
    p = pair(ckpts, name)
    prompts = make_prompts(VOCAB)
    for prompt in prompts:
        assert p.plain(prompt) == pair(ckpts, name, dequantized=True).plain(prompt), name
    check_lossless(p, p.llm(spec, 4), prompts, max_tau=4)


def test_greedy_generation_matches_transformers(ckpts):
    from transformers import AutoModelForCausalLM

    path, plain = ckpts["kimi-int4"]
    ref = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    prompt = make_prompts(VOCAB, lens=(9,), seed=3)[0]
    (out,) = pair(ckpts, "kimi-int4").llm("none").generate([prompt], greedy(20))
    with torch.no_grad():
        x = torch.tensor([prompt])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, min_new_tokens=20,
                            do_sample=False, pad_token_id=-1)[0, len(prompt):].tolist()
    assert out.token_ids == want


# -- tensor parallelism ----------------------------------------------------------------------------

def test_tp2_ddtree_gives_tp1_tokens(ckpts):
    """Kimi K2.6's layout over 2 ranks (gloo): each rank's int4 experts whole, DDTree's tokens TP=1's."""
    p = pair(ckpts, "kimi-int4")
    prompts = make_prompts(VOCAB)
    want = p.llm("ddtree").generate(prompts, mixed())
    with sharded(p, "ddtree", 2) as llm:
        got = llm.generate(prompts, mixed())
        assert llm.engine.agree()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def _rank_logits(tp, paths: list[Path]) -> dict:
    torch.set_num_threads(1)
    out = {}
    for path in paths:
        model, cfg = load_target(path, torch.float32, "cpu", tp)
        out[path.name] = paged_logits(model, cfg)
    return out


def test_tp2_logits_match_tp1(ckpts):
    """Qwen3-MoE int4 (q/k/v rows and o inputs cut per rank on whole groups) and DeepSeek fp8 (q_b_proj
    rows, o_proj inputs and shared experts cut on blocks) over 2 ranks: TP=1's logits."""
    paths = [ckpts["qwen-int4-tp"][0], ckpts["ds-fp8"][0]]
    got = run_ranks(_rank_logits, 2, "cpu", 120.0, paths)
    for path in paths:
        model, cfg = load_target(path, torch.float32, "cpu")
        assert rel(got[path.name], paged_logits(model, cfg)) < 1e-5, path.name


def test_tp_slices_as_stored(ckpts, monkeypatch):
    """What each rank holds, no processes: int4 slices as stored where they cut on groups, and a
    rank refused where they would not (the dense MLP's 20 intermediate inputs a rank, groups of 8),
    before any tensor is read; fp8 slices as stored on block edges, widened off them (DeepSeek's
    o_proj at 4 ranks: 12 inputs a rank, blocks of 8)."""
    path = ckpts["qwen-int4-tp"][0]
    whole, _ = load_target(path, torch.float32, "cpu")
    for rank in range(2):
        model, cfg = load_target(path, torch.float32, "cpu", fake_group(rank, 2))
        o, o_whole = model.layers[1].self_attn.o_proj, whole.layers[1].self_attn.o_proj
        assert isinstance(o, Int4Linear) and o.in_features == 32
        assert torch.equal(o.weight_packed, o_whole.weight_packed[:, rank * 4:(rank + 1) * 4])
        assert torch.equal(o.weight_scale, o_whole.weight_scale[:, rank * 4:(rank + 1) * 4])
        ex = model.layers[0].mlp.experts
        assert isinstance(ex, Int4Experts) and torch.equal(ex.down, whole.layers[0].mlp.experts.down[rank * 4:][:4])
    monkeypatch.setattr(CheckpointTensors, "_read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(ValueError, match=r"tensor 'layers.1.mlp.down_proj.weight': tensor_parallel_size 2 .* "
                                         r"inputs 20:40 of 40, .* int4 groups of 8"):
        load_target(ckpts["qwen-int4"][0], torch.float32, "cpu", fake_group(1, 2))
    monkeypatch.undo()
    fp8 = ckpts["ds-fp8"][0]
    whole, cfg = load_target(fp8, torch.float32, "cpu")
    model, _ = load_target(fp8, torch.float32, "cpu", fake_group(1, 4))
    attn = model.layers[1].self_attn
    assert isinstance(attn.q_b_proj, Fp8BlockLinear) and type(attn.o_proj) is torch.nn.Linear
    w = whole.layers[1].self_attn.o_proj
    assert torch.equal(attn.o_proj.weight, dequantize(w.weight, w.weight_scale_inv, w.block)[:, 12:24])


# -- random weights in the stored forms --------------------------------------------------------------

def test_random_shapes_with_stored_experts(ckpts):
    """'name:int4' / 'name:fp8' (before or after '@N') build the routed experts as stored, drawn
    as such; the existing shapes are unchanged, and a shape without experts is refused."""
    assert parse_shape("kimi-k2@3:int4") == parse_shape("kimi-k2:int4@3") == ("kimi-k2", "3", "int4")
    assert shape_config("kimi-k2:fp8@3")[0] == shape_config("kimi-k2@3")[0]
    with pytest.raises(ValueError, match="no routed experts"):
        shape_config("qwen3-8b:int4")
    with pytest.raises(ValueError, match="unknown experts' form 'int3'"):
        random_target("kimi-k2@2:int3", torch.device("cpu"), torch.float32)
    cfg = ModelConfig.from_dir(ckpts["kimi-int4"][1])
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=128))
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    for form, cls in (("int4", Int4Experts), ("fp8", Fp8BlockExperts)):
        model = random_model(cfg, torch.device("cpu"), torch.float32, experts=form)
        ex = model.layers[1].mlp.experts
        assert isinstance(ex, cls) and ex.gate_up.shape[:2] == (8, 256)
        assert ex.gate_up.dtype == (torch.int32 if form == "int4" else torch.float8_e4m3fn)
        w = ex.gate_up.view(torch.uint8 if form == "fp8" else torch.int32)
        assert w.float().std() > 0 and ex.gate_up_scale.float().min() > 0
        assert torch.isfinite(our_logits(model, cfg, ids, [(0, 5)])).all()
