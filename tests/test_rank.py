"""One rank of a tensor-parallel group on one device (`TPGroup.simulated_rank`, `bench.rank`): the
simulated rank builds a real rank's shards and runs its collectives as local operations on the same
bytes, without a process group; the rank benchmark runs end to end on the CPU and its memory
agrees with the memory plan; the engine refuses, before loading, weights its device cannot hold."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from drafttree.bench import rank as rank_bench
from drafttree.bench import rank_costs
from drafttree.config import ModelConfig
from drafttree.engine.config import EngineConfig
from drafttree.engine.launch import run_ranks
from drafttree.engine.memory_plan import Device, GiB, plan_memory, read_config, shape_quantization
from drafttree.models.random_shapes import random_drafter_config, random_model, shape_config
from drafttree.parallel import comm
from drafttree.parallel.group import TPGroup
from drafttree.phases import Phase, SpecConfig
from tests.moe_tiny import our_logits

TINY = "tiny-mla:int4"   # MLA with q-LoRA, 8 int4 experts (top 2), a shared expert, the first layer dense
CPU = torch.device("cpu")
KIMI = Path(__file__).parent / "fixtures" / "kimi-k2.6"   # Kimi K2.6's config.json (tests/test_memory_plan.py)


def rank_view(tp: TPGroup) -> tuple[dict, list]:
    """A rank's tensors (name -> shape, dtype) and the collectives of a prefill and a decode step."""
    cfg = shape_config(TINY)[0]
    model = random_model(cfg, CPU, torch.float32, tp, "int4")
    tensors = {n: (tuple(t.shape), t.dtype) for n, t in (*model.named_parameters(), *model.named_buffers())}
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with comm.recording() as ops:
        our_logits(model, cfg, ids, [(0, 5), (5, 6)])
    return tensors, list(ops)


def _ranks_views(tp: TPGroup) -> list:
    return comm.gather_objects(rank_view(tp), tp)


def test_a_simulated_rank_is_a_real_ranks_shards_and_collectives(monkeypatch):
    """Each rank of a real gloo group of 2 against the simulated rank of the same index: the same
    tensors (shapes and stored dtypes: int4 words, bf16 scales), the same collectives in the same
    order and sizes; the simulated one runs without a process group, each collective through its
    local operation."""
    real = run_ranks(_ranks_views, 2, "cpu", 120.0)
    assert not dist.is_initialized()
    calls: Counter = Counter()
    for name in ("local_all_reduce", "local_all_gather"):
        original = getattr(comm, name)
        monkeypatch.setattr(comm, name, lambda *a, _f=original, _n=name: (calls.update([_n]), _f(*a))[1])

    def no_group(*a, **k):
        raise AssertionError("a simulated rank called torch.distributed")
    for name in ("all_reduce", "broadcast_object_list", "all_gather_object"):
        monkeypatch.setattr(dist, name, no_group)
    monkeypatch.setattr(comm, "_gather_into", no_group)
    for rank in range(2):
        calls.clear()
        tensors, ops = rank_view(TPGroup.simulated_rank(rank, 2, CPU))
        assert tensors == real[rank][0] and ops == real[rank][1], rank
        kinds = Counter(op for op, _, _ in ops)
        layers = shape_config(TINY)[0].num_layers
        assert kinds == {"all_reduce": 2 * (1 + 2 * layers), "all_gather": 2}   # two forwards
        assert calls == {"local_all_reduce": kinds["all_reduce"], "local_all_gather": kinds["all_gather"]}
    experts = tensors["layers.1.mlp.experts.gate_up"]
    assert experts == ((4, 64, 64 // 8), torch.int32)   # 4 of 8 experts, int4 words
    tp = TPGroup.simulated_rank(1, 2, CPU)
    assert comm.from_leader(3, tp) == 3 and comm.smallest(5, tp) == 5 and comm.gather_objects("x", tp) == ["x"] * 2
    with pytest.raises(ValueError, match="rank 2 of 2"):
        TPGroup.simulated_rank(2, 2, CPU)


def test_local_operations_keep_the_bytes_and_shapes():
    """The local all-reduce reads and writes its tensor in place, unchanged; the all-gather fills the
    whole output from this rank's part (every rank's slot)."""
    tp = TPGroup.simulated_rank(0, 4, CPU)
    x = torch.randn(2, 3, 5)
    y = x.clone()
    assert comm.all_reduce(y, tp) is y and torch.equal(y, x)
    assert torch.equal(comm.gather_last(x, tp), x.repeat(1, 1, 4))
    assert torch.equal(comm.gather_first(x, tp), x.expand(4, 2, 3, 5))
    ops = [("all_reduce", (2, 8), torch.float32), ("all_gather", (3, 4), torch.bfloat16)]
    comm.replay(ops, tp, CPU)()   # the recorded collectives replay as local operations too
    got = rank_costs.collectives(ops, 8, 1e9, latency_s=1e-6)
    assert got["message_bytes"] == 2 * 8 * 4 + 3 * 4 * 2
    assert got["link_bytes_per_rank"] == int(2 * 7 / 8 * 64 + 7 * 24) and got["latency_ms"] == pytest.approx(2e-3)


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rank") / "rank.json"
    assert rank_bench.main(["--random-weights", TINY, "--simulate-rank", "1", "--tensor-parallel-size", "2",
                            "--batch", "1,4", "--budgets", "4,8", "--prompt-len", "20", "--max-model-len", "200",
                            "--iters", "1", "--device", "cpu", "--profile", "5", "--out", str(out)]) == 0
    assert not dist.is_initialized()
    return json.loads(out.read_text())


def test_bench_rank_reports_every_field(bench_json):
    res = bench_json
    assert {"model", "rank", "tensor_parallel_size", "device", "dtype", "graphed", "prompt_len", "kv_len",
            "max_model_len", "max_num_seqs", "spec", "collectives_as_local_ops", "bandwidths", "acceptance",
            "routing", "weights_read", "memory", "batches", "seconds"} <= res.keys()
    assert (res["rank"], res["tensor_parallel_size"], res["graphed"]) == (1, 2, False)
    assert [b["batch"] for b in res["batches"]] == [1, 4]
    cfg = shape_config(TINY)[0]
    for b in res["batches"]:
        d = b["decode"]
        k = d["kernels"]   # --profile 5: the decode step's ops by name (on the CPU, their CPU time)
        assert 0 < len(k["top"]) <= 5 and k["count_per_step"] >= len(k["top"]) and k["us_per_step"] > 0
        assert all(x["name"] and x["per_step"] > 0 for x in k["top"])
        assert k["per_layer"] == pytest.approx(k["count_per_step"] / cfg.num_layers) and k["share_of_step"] > 0
        assert [x["us"] for x in k["top"]] == sorted((x["us"] for x in k["top"]), reverse=True)
        assert d["ms"] > 0 and d["weight_floor_ms"] > 0
        assert d["over_floor"] == pytest.approx(d["ms"] / d["weight_floor_ms"])
        assert d["collectives"]["by_kind"] == {"all_reduce": 1 + 2 * cfg.num_layers, "all_gather": 1}
        assert b["draft_collectives"]["by_kind"] == {"all_reduce": 1, "all_gather": 1}   # the borrowed embedding, head
        assert set(b["budgets"]) == {"4", "8"}
        for n, v in b["budgets"].items():
            assert v["round_ms"] > 0 and v["round_in_decode_steps"] == pytest.approx(v["round_ms"] / d["ms"])
            e = v["experts"]
            assert e["tokens"] == b["bucket"] * (int(n) + 1) and e["held_per_layer"] == 4
            assert 0 <= e["per_layer_min"] <= e["per_layer_mean"] <= e["per_layer_max"] <= 4
            assert e["every_rank_per_layer_mean"] >= 2   # each token picks 2 distinct experts
            assert v["verify_collectives"]["count"] == 2 + 2 * cfg.num_layers
        assert b["choice"]["picked"] in (0, 4, 8) and set(b["choice"]["tokens_per_s"]) == {"0", "4", "8"}
        assert set(b["skewed"]["budgets"]) == {"4", "8"} and b["skewed"]["decode"]["ms"] > 0
    assert "x.mul_(1)" in res["collectives_as_local_ops"]["all_reduce"]
    assert "drafter_data" in res["acceptance"]["source"]


def test_bench_rank_memory_is_the_plans(bench_json):
    """On the CPU the rank's tensors against the memory plan for the same config (computed here):
    to the byte, the pool's pages as the engine sizes them."""
    mem = bench_json["memory"]
    cfg = shape_config(TINY)[0]
    drafter = random_drafter_config(TINY, cfg)
    spec = SpecConfig("ddtree", drafter.block_size, 8, adaptive=True)
    plan = plan_memory(cfg, shape_quantization("int4"), drafter, spec=spec, tensor_parallel_size=2,
                       max_model_len=200, max_num_seqs=4, dtype=torch.float32, kv_cache_memory_gb=1.0,
                       cuda_graphs=False)
    share = next(r for r in plan.ranks if 1 in r.ranks)
    assert mem["plan"]["weights"] == share.weight_bytes and mem["plan"]["kv_pool"] == plan.pool_bytes(share)
    assert mem["measured"]["pool_pages"] == plan.pool_pages
    assert mem["within_5_percent"] and all(abs(r - 1) <= 0.05 for r in mem["measured_over_plan"].values())
    assert mem["measured"]["weights"] == share.weight_bytes   # the tensors built: the plan to the byte


def test_random_kimi_shapes_plan_as_the_published_checkpoint():
    """'kimi-k2:int4' plans its routed experts in Kimi K2.6's stored int4 and the rest as the
    checkpoint keeps them; ':fp8' as DeepSeek-V3's blocks."""
    cfg = shape_config("kimi-k2:int4")[0]
    weights = plan_memory(cfg, shape_quantization("int4"), tensor_parallel_size=8).ranks[0].weights
    raw = read_config(KIMI)
    assert weights == plan_memory(ModelConfig.from_dict(raw), raw, tensor_parallel_size=8).ranks[0].weights
    assert weights["routed experts"] == 60 * 48 * 3 * (2048 * 7168 // 2 + 2048 * 224 * 2)
    fp8 = plan_memory(cfg, shape_quantization("fp8"), tensor_parallel_size=8).ranks[0].weights
    assert fp8["routed experts"] == 60 * 48 * 3 * (2048 * 7168 + 16 * 56 * 4)
    assert {k: v for k, v in fp8.items() if k != "routed experts"} == \
        {k: v for k, v in weights.items() if k != "routed experts"}


def test_a_rank_of_dense_layers_only_reports_without_experts(capsys):
    """--num-layers within the dense first layers: no routed expert to count or skew."""
    assert rank_bench.main(["--random-weights", TINY, "--num-layers", "1", "--tensor-parallel-size", "2",
                            "--batch", "1", "--budgets", "4", "--prompt-len", "8", "--max-model-len", "64",
                            "--iters", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "skewed routing" not in out


def test_bench_rank_refuses_bad_options(capsys):
    for args, match in ((["--budgets", "3,8"], "powers of two from 4"),
                        (["--simulate-rank", "2"], "a rank of 0..1"),
                        (["--acceptance", "4:2.4"], "no expected tokens for budgets \\[8\\]"),
                        (["--acceptance", "4:0.5,8:2"], "expected tokens >= 1"),
                        (["--tensor-parallel-size", "3"], "does not divide")):
        with pytest.raises(SystemExit):
            rank_bench.main(["--random-weights", TINY, "--tensor-parallel-size", "2", "--device", "cpu",
                             "--budgets", "4,8", *args])
        assert re.search(match, capsys.readouterr().err), (args, match)


def test_the_cost_model_picks_as_the_engine_prices():
    """Tokens per second of each budget as `BudgetChooser` prices a round: decode plus a share of the
    context phase for 0, draft plus verify otherwise."""
    spec = SpecConfig("ddtree", 16, 8, adaptive=True)
    seconds = {(Phase.DECODE, 1): 1.0, (Phase.CONTEXT, 64): 6.3, (Phase.DRAFT, 16): 0.5, (Phase.VERIFY, 5): 1.0,
               (Phase.VERIFY, 9): 1.5}
    got = rank_costs.pick_budget(spec, 1, 1, [4, 8], seconds, {4: 2.37, 8: 2.61})
    assert got["tokens_per_s"] == {"0": round(1 / 1.1, 1), "4": round(2.37 / 1.5, 1), "8": round(2.61 / 2.0, 1)}
    assert got["picked"] == 4


def test_the_engine_refuses_weights_its_device_cannot_hold_before_loading(monkeypatch):
    """The start-up plan (on CUDA the device's total; here a fake device) refuses with the plan's
    table before a weight is read; on a device that holds them the engine keeps the plan."""
    from drafttree.engine import engine as engine_module
    from drafttree.engine import memory_plan
    from drafttree.engine.engine import Engine

    cfg = EngineConfig(random_weights=TINY, spec="none", device="cpu", max_num_seqs=2, max_model_len=64)
    monkeypatch.setattr(memory_plan, "startup_device", lambda setup: Device.of(0.5))
    monkeypatch.setattr(engine_module, "load_models", lambda *a: pytest.fail("weights were loaded"))
    with pytest.raises(ValueError, match="does not fit: the weights alone take") as e:
        Engine(cfg)
    assert "routed experts" in str(e.value) and "device: 0.50 GiB" in str(e.value)
    monkeypatch.undo()
    monkeypatch.setattr(memory_plan, "startup_device", lambda setup: Device.of(2))
    eng = Engine(cfg)
    assert eng.memory_plan.weights_fit() and eng.memory_plan.device.total_bytes == 2 * GiB
    monkeypatch.undo()
    assert Engine(cfg).memory_plan is None   # the CPU: no device to plan for


@pytest.mark.gpu
def test_bench_rank_on_the_gpu(tmp_path):
    """Kimi K2's rank 0 of 8 at 3 layers, graphed: its memory within 5 % of the plan, a decode step
    and every round timed."""
    out = tmp_path / "rank.json"
    assert rank_bench.main(["--random-weights", "kimi-k2:int4", "--num-layers", "3", "--simulate-rank", "0",
                            "--tensor-parallel-size", "8", "--batch", "1,16", "--budgets", "4,8,16,32",
                            "--max-model-len", "8192", "--iters", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["graphed"] and res["memory"]["within_5_percent"], res["memory"]["measured_over_plan"]
    assert all(v["round_ms"] > 0 for b in res["batches"] for v in b["budgets"].values())
