"""The memory plan per GPU (`engine/memory_plan.py`): Kimi K2.6's public config at TP 8 against a
count from its shapes, refusals that name what does not fit, and the bytes of the modules drafttree
actually builds (dense on the CPU, a tiny MoE's two TP ranks on the meta device).

tests/fixtures/kimi-k2.6/config.json: moonshotai's config.json for Kimi K2.6, the
KimiK25ForConditionalGeneration wrapper whose text_config holds the language model (DeepseekV3's
shape) and its compressed-tensors quantization_config, with the fields and values public records
of the K2.5 / K2.6 configs give (K2.6 keeps K2.5's language model and int4 scheme).
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from drafttree.cli import main
from drafttree.config import ModelConfig
from drafttree.engine.memory_plan import (CONTEXT_GIB, KINDS, NCCL_GIB, Device, GiB, plan_memory, read_config,
                                          weight_format)
from drafttree.models.kv_cache import KVLayout
from drafttree.phases import SpecConfig
from drafttree.runner.cuda_graph import graph_plan
from drafttree.runner.model_runner import CacheConfig
from drafttree.runner.round_buffers import allocate_round_state, round_buffer_bytes
from tests.moe_tiny import SHAPES as MOE_SHAPES

KIMI = Path(__file__).parent / "fixtures" / "kimi-k2.6"


def kimi() -> tuple[ModelConfig, dict]:
    raw = read_config(KIMI)
    return ModelConfig.from_dict(raw), raw


def test_the_public_kimi_k26_config_is_deepseek_v3_with_int4_routed_experts():
    cfg, raw = kimi()
    m, a = cfg.moe, cfg.mla
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg.arch == "deepseek_v3"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size, cfg.intermediate_size) == \
        (61, 7168, 64, 163840, 18432)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert (m.num_experts, m.top_k, m.intermediate_size, m.num_shared, m.sparse_layers) == \
        (384, 8, 2048, 1, tuple(range(1, 61)))
    fmt = weight_format(raw)
    assert (fmt.method, fmt.group_size, fmt.scale_bytes, fmt.prefix) == ("int4", 32, 2, "language_model.")
    quantized = {n: fmt.quantizes(n) for n in (
        "model.layers.5.mlp.experts.383.down_proj", "model.layers.1.mlp.experts.0.gate_proj",
        "model.layers.5.self_attn.q_b_proj", "model.layers.5.mlp.shared_experts.up_proj",
        "model.layers.0.mlp.gate_proj", "lm_head")}
    assert [n for n, packed in quantized.items() if packed] == ["model.layers.5.mlp.experts.383.down_proj",
                                                                 "model.layers.1.mlp.experts.0.gate_proj"]


def kimi_tp8_bytes(int4: bool) -> dict[str, int]:
    """One rank's bytes at TP 8, counted from Kimi K2.6's shapes: H/8 heads of MLA (the latent path
    whole), the dense MLP's and the shared expert's rows / 8, 48 whole experts, 20480 vocabulary rows."""
    D, L, V, N, bf16 = 7168, 61, 163840, 8, 2
    h = 64 // N

    def expert_matrix(rows: int, cols: int) -> int:   # int4 packed in int32 words, a bf16 scale per 32 inputs
        return rows * cols // 2 + rows * (cols // 32) * bf16 if int4 else rows * cols * bf16
    mla = 1536 * D + 1536 + h * 192 * 1536 + 576 * D + 512 + h * 256 * 512 + D * h * 128   # q_a, norm, q_b, kv_a, ...
    return {"attention": L * bf16 * mla,
            "dense MLP": bf16 * 3 * D * (18432 // N),
            "shared experts": 60 * bf16 * 3 * D * (2048 // N),
            "routed experts": 60 * (384 // N) * (2 * expert_matrix(2048, D) + expert_matrix(D, 2048)),
            "embedding + LM head": 2 * (V // N) * D * bf16,
            "router / norms": (2 * L + 1) * D * bf16 + 60 * (384 * D + 384) * 4,
            "drafter": 0}


@pytest.mark.parametrize("utilization", [0.9, 0.95])
def test_kimi_k26_fits_on_eight_h200s(utilization):
    cfg, raw = kimi()
    plan = plan_memory(cfg, raw, tensor_parallel_size=8, max_num_seqs=16, gpu_memory_utilization=utilization)
    want = kimi_tp8_bytes(int4=True)
    assert [r.ranks for r in plan.ranks] == [tuple(range(8))] and plan.ranks[0].weights == want
    weights = sum(want.values())
    bpt = 61 * (512 + 64) * 2                      # MLA: the latent and the roped key, every rank whole
    graphs = max(e.est_bytes for e in graph_plan(SpecConfig(), cfg, None, 16, [262144], 8))
    pages = CacheConfig(16, 262144, SpecConfig().kv_headroom).pages_per_row
    buffers = round_buffer_bytes(cfg, SpecConfig(), 0, 16, pages, torch.bfloat16)
    assert buffers >= 16 * 9 * cfg.vocab_size   # the logits processing's counts, prompt flags and bias
    total = plan.device.total_bytes
    assert total == 139 * GiB and "assumed: an H200" in plan.format()
    budget = int(utilization * total) - weights - int((CONTEXT_GIB + NCCL_GIB) * GiB) - graphs - buffers
    tokens = (budget // (bpt * 16) - 1) * 16
    assert plan.ranks[0].kv_bytes_per_token == bpt and plan.kv_tokens == tokens
    assert plan.requests_at_max_len == tokens // 16 // math.ceil((262144 + 1) / 16) >= 1
    plan.check()
    assert f"fits: {tokens:,} KV tokens per GPU" in plan.format()


def test_kimi_k26_in_bf16_is_refused_naming_the_weights():
    cfg, raw = kimi()
    raw = copy.deepcopy(raw)
    del raw["text_config"]["quantization_config"]
    plan = plan_memory(cfg, raw, tensor_parallel_size=8, max_num_seqs=16, gpu_memory_utilization=0.9)
    assert plan.ranks[0].weights == kimi_tp8_bytes(int4=False)
    with pytest.raises(ValueError, match=r"does not fit: the weights alone take 241\.\d\d GiB per GPU .*routed experts "
                                         r"236\.\d\d GiB.*at -tp 16") as e:
        plan.check()
    assert "routed experts" in str(e.value).splitlines()[7]   # the table comes with it


def test_kv_under_one_request_names_the_longest_context():
    cfg, raw = kimi()
    plan = plan_memory(cfg, raw, tensor_parallel_size=8, max_num_seqs=16, gpu_memory_utilization=0.9,
                       device=Device.of(90))
    assert 0 < plan.kv_tokens < 262144
    with pytest.raises(ValueError, match=f"holds {plan.kv_tokens:,} tokens per GPU, under one request at "
                                         f"max_model_len 262,144 .*the model's length, which the engine would lower.*"
                                         f"--max-model-len {plan.kv_tokens - 1:,} or less fits"):
        plan.check()
    plan_memory(cfg, raw, tensor_parallel_size=8, max_model_len=plan.kv_tokens - 1, max_num_seqs=16,
                gpu_memory_utilization=0.9, device=Device.of(90)).check()
    with pytest.raises(ValueError, match="the KV cache gets 0.00 GiB per GPU.*raise --gpu-memory-utilization"):
        plan_memory(cfg, raw, tensor_parallel_size=8, gpu_memory_utilization=0.9, device=Device.of(79)).check()


def test_quantization_rules():
    cfg, raw = kimi()
    q = raw["text_config"]["quantization_config"]
    shared = copy.deepcopy(raw)   # the shared experts no longer ignored: packed too
    shared["text_config"]["quantization_config"]["ignore"] = [p for p in q["ignore"] if "shared" not in p]
    got = plan_memory(cfg, shared, tensor_parallel_size=8).ranks[0].weights["shared experts"]
    assert got == 60 * (2 * (256 * 7168 // 2 + 256 * 224 * 2) + 7168 * 256 // 2 + 7168 * 8 * 2)
    for change in ({"format": "nvfp4-pack-quantized"}, {"quant_method": "awq"},
                   {"config_groups": {"g": {"weights": {**q["config_groups"]["group_0"]["weights"],
                                                        "symmetric": False}}}}):
        bad = copy.deepcopy(raw)
        bad["text_config"]["quantization_config"].update(change)
        with pytest.raises(ValueError, match="unsupported checkpoint quantization.*drafttree loads compressed-tensors "
                                             "'pack-quantized' int4"):   # the loader's own refusal
            plan_memory(cfg, bad, tensor_parallel_size=8)
    fp8 = {**raw["text_config"], "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    w = plan_memory(cfg, fp8, tensor_parallel_size=8).ranks[0].weights
    assert w["routed experts"] == 60 * 48 * 3 * (2048 * 7168 + 16 * 56 * 4)
    assert w["embedding + LM head"] == kimi_tp8_bytes(int4=True)["embedding + LM head"]   # not layers: bf16


def test_option_errors():
    cfg, raw = kimi()
    for kwargs, match in (({"tensor_parallel_size": 5}, "tensor_parallel_size 5 does not divide"),
                          ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
                          ({"gpu_memory_utilization": 0.9, "kv_cache_memory_gb": 10}, "not both"),
                          ({"draft_quantization": "int4"}, "unknown draft quantization")):
        with pytest.raises(ValueError, match=match):
            plan_memory(cfg, raw, **kwargs)
    with pytest.raises(ValueError, match="--gpu-memory-gb must be > 0"):
        Device.of(0)
    with pytest.raises(ValueError, match="does not fit beside the weights"):
        plan_memory(cfg, raw, tensor_parallel_size=8, kv_cache_memory_gb=100).check()


# -- against the modules drafttree builds -------------------------------------------------------------

def kind_of(name: str) -> str:
    """A built parameter's kind, from its name alone."""
    if name.startswith(("embed_tokens.", "lm_head.")):
        return "embedding + LM head"
    for part, kind in ((".self_attn.", "attention"), (".mlp.experts.", "routed experts"),
                       (".mlp.shared.", "shared experts"), (".mlp.router.", "router / norms"), (".mlp.", "dense MLP")):
        if part in name:
            return kind
    assert name.endswith("layernorm.weight") or name == "norm.weight", name
    return "router / norms"


def built_bytes(model: torch.nn.Module) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for name, p in model.named_parameters():
        out[kind_of(name)] += p.numel() * p.element_size()
    return out


def close(plan: dict[str, int], built: dict[str, int]) -> bool:
    """To the byte (the 1 % a plan may miss by would hide a missing norm in these tiny shapes)."""
    return plan == built and sum(built.values()) > 0


DENSE = {"qwen3": dict(arch="qwen3", qk_norm=True, num_kv_heads=2),
         "qwen2-tied": dict(arch="qwen2", attention_bias=True, tie_word_embeddings=True, num_kv_heads=2),
         "llama-gqa3": dict(arch="llama", num_heads=9, num_kv_heads=3, head_dim=8, hidden_size=36)}


@pytest.mark.parametrize("shape", sorted(DENSE))
def test_a_dense_plan_is_the_bytes_of_the_model_built_on_the_cpu(shape):
    from drafttree.models.random_shapes import random_model

    cfg = ModelConfig(**{**dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                head_dim=16), **DENSE[shape]})
    model = random_model(cfg, torch.device("cpu"), torch.bfloat16)
    plan = plan_memory(cfg, None, max_model_len=64, max_num_seqs=2, device=Device.of(1), cuda_graphs=False)
    assert close(plan.ranks[0].weights, built_bytes(model))
    assert plan.ranks[0].kv_bytes_per_token == model.kv_layout.bytes_per_token(torch.bfloat16)


def fake_group(rank: int, world: int):
    from drafttree.parallel.group import TPGroup
    return TPGroup(rank, world, torch.device("cpu"), None, None, 60.0)


def moe_config(shape: str, **changes) -> ModelConfig:
    spec = {**MOE_SHAPES[shape], **changes}
    arch = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[spec.pop("arch")]
    return ModelConfig.from_dict({"architectures": [arch], "vocab_size": 97, "intermediate_size": 40,
                                  "num_hidden_layers": 3, **spec})


@pytest.mark.parametrize("cfg", [moe_config("deepseek_v3", attention_bias=True), moe_config("qwen3_moe"),
                                 moe_config("deepseek_v3_plain"),
                                 ModelConfig("llama", 97, 36, 64, 2, 9, 3, 8)],
                         ids=["mla-bias", "qwen3-moe", "mla", "gqa3"])
def test_each_tp2_rank_plans_the_shards_it_builds(cfg):
    """On the meta device, each of two ranks' modules (`parallel.shard`): the plan's rank holds them,
    where ranks differ too (o_proj's bias on rank 0; three KV heads split 2 + 1)."""
    from drafttree.models.moe_decoder import build_target, fp32_parameters

    plan = plan_memory(cfg, None, tensor_parallel_size=2, max_model_len=64, max_num_seqs=2, device=Device.of(1),
                       cuda_graphs=False)
    for rank in range(2):
        with torch.device("meta"):
            model = build_target(cfg, fake_group(rank, 2)).to(torch.bfloat16)
        for name in fp32_parameters(model):
            model.get_parameter(name).data = model.get_parameter(name).data.float()
        share = next(r for r in plan.ranks if rank in r.ranks)
        assert close(share.weights, built_bytes(model)), (rank, share.weights, built_bytes(model))
        assert share.kv_bytes_per_token == model.kv_layout.bytes_per_token(torch.bfloat16)
    assert len(plan.ranks) == (1 if cfg.moe is not None and not cfg.attention_bias else 2)


def test_the_drafter_whole_and_in_fp8():
    from drafttree.models import quant
    from drafttree.models.random_shapes import drafter_for, random_model

    cfg = ModelConfig("qwen3", 97, 32, 64, 4, 4, 2, 16, qk_norm=True)
    target = random_model(cfg, torch.device("cpu"), torch.bfloat16)
    drafter = drafter_for(target, torch.device("cpu"), torch.bfloat16, block_size=4, layers=2)
    spec = SpecConfig("ddtree", block_size=4, budget=8)
    for quantization in (None, "fp8"):
        if quantization:
            quant.quantize_drafter(drafter, quantization)
        tensors = [t for n, t in [*drafter.named_parameters(), *drafter.named_buffers()] if "rotary" not in n]
        tensors += list(drafter.__dict__["draft_head"].buffers()) if quantization else []
        plan = plan_memory(cfg, None, drafter.cfg, spec=spec, max_model_len=64, max_num_seqs=2, device=Device.of(1),
                           draft_quantization=quantization)
        assert plan.ranks[0].weights["drafter"] == sum(t.numel() * t.element_size() for t in tensors)
        assert plan.ranks[0].kv_bytes_per_token == sum(KVLayout.of(c).bytes_per_token(torch.bfloat16)
                                                       for c in (cfg, drafter.cfg.model))


# -- the command ---------------------------------------------------------------------------------------

def test_graphs_prints_the_plan_from_a_config_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert main(["graphs", "--model", str(KIMI), "-tp", "8", "--max-num-seqs", "16", "--gpu-memory-utilization",
                 "0.95"]) == 0
    out = capsys.readouterr().out
    cfg, raw = kimi()
    tokens = plan_memory(cfg, raw, tensor_parallel_size=8, max_num_seqs=16, gpu_memory_utilization=0.95).kv_tokens
    assert "assumed: an H200" in out and "routed experts int4" in out and f"fits: {tokens:,} KV tokens per GPU" in out
    raw = copy.deepcopy(raw)
    del raw["text_config"]["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["graphs", "--model", str(tmp_path), "-tp", "8", "--gpu-memory-gb", "200"]) == 0
    out = capsys.readouterr().out
    assert "device: 200.00 GiB, --gpu-memory-gb" in out and "does not fit: the weights alone take 241." in out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["kimi-k2@2", "qwen3-30b-a3b@4"])
def test_planned_weights_are_what_cuda_allocates(shape):
    """The plan's weights against what a random-weight target allocates on the GPU; prints the
    memory outside torch's allocator (the CUDA context), which CONTEXT_GIB allows for."""
    from drafttree.models.random_shapes import random_model, shape_config

    cfg = shape_config(shape)[0]
    before = torch.cuda.memory_allocated()
    model = random_model(cfg, torch.device("cuda"), torch.bfloat16)
    held = torch.cuda.memory_allocated() - before
    free, total = torch.cuda.mem_get_info()
    plan = plan_memory(cfg, None, device=Device.of(cuda_total=total), cuda_graphs=False)
    assert abs(sum(plan.ranks[0].weights.values()) - held) <= 0.01 * held
    print(f"{shape}: planned {sum(plan.ranks[0].weights.values()) / GiB:.3f} GiB, allocated {held / GiB:.3f} GiB; "
          f"outside the allocator {(total - free - torch.cuda.memory_reserved()) / GiB:.2f} GiB "
          f"(allowance {CONTEXT_GIB} GiB)")
    del model


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("ddtree", 8, 32), SpecConfig("dflash", 16)],
                         ids=["none", "ddtree", "dflash"])
def test_round_buffers_counted_as_allocated(spec):
    """The plan's round buffers are the bytes the runner's allocation takes (counted on the meta
    device; here against the same allocation on the CPU, every storage once)."""
    cfg = ModelConfig("llama", 1000, 64, 128, 2, 4, 2, 16)
    layers = 2 if spec.speculative else 0
    pages_per_row = CacheConfig(5, 300, spec.kv_headroom, 16).pages_per_row
    state = allocate_round_state(cfg, spec, 5, pages_per_row, layers * cfg.hidden_size, torch.float32, "cpu")
    storages: dict[int, int] = {}

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                walk(getattr(x, name))
    walk(state)
    assert round_buffer_bytes(cfg, spec, layers, 5, pages_per_row, torch.float32) == sum(storages.values())


def test_graph_pool_set_aside_for_the_graphs_captured():
    """The graphs' estimate counts what the engine captures: without the processed rounds' graphs
    (as `generate` runs), or within a shorter graph length, less memory is set aside."""
    cfg, raw = kimi()
    kw = dict(tensor_parallel_size=8, max_num_seqs=16, gpu_memory_utilization=0.9)
    full = plan_memory(cfg, raw, **kw)
    free = plan_memory(cfg, raw, processed_graphs=False, **kw)
    short = plan_memory(cfg, raw, graph_len=4096, **kw)
    assert free.graph_bytes == max(e.est_bytes for e in graph_plan(SpecConfig(), cfg, None, 16, [262144], 8,
                                                                   processed=False))
    assert free.graph_bytes < full.graph_bytes and short.graph_bytes < full.graph_bytes
    assert free.kv_tokens > full.kv_tokens


def test_the_start_up_plan_imports_nothing_a_start_that_compiles_nothing_would_not():
    """The plan counts the round buffers on the meta device, where some ops (torch.eye) run as
    torch's reference implementations and import sympy and ~900 modules: seconds of every GPU
    start before its weights. Run in a fresh process, where nothing else imported them first."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from drafttree.engine.config import EngineConfig\n"
            "from drafttree.engine.plan import resolve\n"
            "from drafttree.engine.memory_plan import Device, plan_for_setup\n"
            "before = set(sys.modules)\n"
            "plan = plan_for_setup(resolve(EngineConfig(), None), Device.of(gpu_memory_gb=80))\n"
            "assert plan.buffer_bytes > 0, plan.buffer_bytes\n"
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('sympy', 'mpmath')"
            " or m.startswith(('torch._refs', 'torch._prims', 'torch._dynamo'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
