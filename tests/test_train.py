"""Drafter training on tiny random targets: the recipe's block layout, the training forward
against the inference drafter, learning, checkpoint/resume, the published format, and τ."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from drafttree.loader.weights import load_target
from drafttree.loader.drafter import load_drafter
from drafttree.models.kv_cache import KVCache, attn_meta
from drafttree.prompts import (
    Conversation,
    iter_json_array,
    load_sharegpt_conversations,
    load_sharegpt_prompts,
    read_prompts,
    write_prompts,
)
from drafttree.train.cli import main
from drafttree.train.data import TrainSequence, closing_loop, read_sequences, write_sequences
from drafttree.train.forward import FeatureExtractor, drafter_train_forward
from drafttree.train.recipe import (
    IGNORE,
    build_blocks,
    default_gamma,
    default_target_layer_ids,
    sample_anchors,
)
from drafttree.train.regen import RegenConfig, regenerate
from drafttree.train.trainer import TrainConfig, Trainer
from tests.tiny import make_target

V = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny target (sharp logits: a learnable deterministic pattern) and its own greedy
    responses to token-id prompts, regenerated through the engine."""
    root = tmp_path_factory.mktemp("train")
    target_dir = make_target(root / "target", vocab=V, layers=4, scale=3.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(V - 1) for _ in range(rng.randint(2, 6))] for _ in range(48)]
    write_prompts(root / "prompts.jsonl", prompts)
    rc = RegenConfig(target=str(target_dir), device="cpu", max_num_seqs=16, max_prompt_tokens=16, max_tokens=48)
    regenerate(prompts, root / "responses.jsonl", rc, progress=False)
    target, _ = load_target(target_dir, torch.float32, "cpu")
    return {"root": root, "target_dir": target_dir, "target": target, "prompts": prompts, "regen": rc,
            "seqs": read_sequences(root / "responses.jsonl")}


def tiny_config(out: Path, **kw) -> TrainConfig:
    base = {"out": out, "device": "cpu", "block_size": 4, "draft_layers": 1, "intermediate_size": 64,
            "num_target_features": 2, "anchors_per_seq": 64, "batch_size": 8, "epochs": 100, "lr": 3e-3,
            "mask_token_id": V - 1, "progress": False, "log_every": 5, "save_dtype": "fp32"}
    base.update(kw)
    return TrainConfig(**base)


def test_layer_ids_and_gamma():
    assert default_target_layer_ids(30, 5) == [1, 7, 14, 21, 27]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(4, 2) == [1, 2]
    assert default_target_layer_ids(3, 3) == [0, 1, 2]
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def test_blocks_pin_anchor_labels_and_context():
    T, bs, mask_id = 10, 4, 99
    ids = torch.arange(100, 110)[None]                 # token at position p is 100 + p
    blocks = build_blocks(ids, torch.tensor([T]), torch.tensor([[3, 6]]), torch.ones(1, 2, dtype=torch.bool),
                          bs, mask_id)
    assert blocks.ids.tolist() == [[103, 99, 99, 99, 106, 99, 99, 99]]
    assert blocks.pos.tolist() == [[3, 4, 5, 6, 6, 7, 8, 9]]
    assert blocks.labels.tolist() == [[IGNORE, 104, 105, 106, IGNORE, 107, 108, 109]]
    m = blocks.dense_mask(T)[0]                        # [8 queries, 10 context + 8 block keys]
    for q in range(8):
        ctx = m[q, :T].nonzero().squeeze(1).tolist()
        own = (m[q, T:].nonzero().squeeze(1) // bs).tolist()
        assert ctx == ([0, 1, 2] if q < 4 else [0, 1, 2, 3, 4, 5])
        assert own == [q // bs] * bs
    # labels past the sequence end are ignored
    short = build_blocks(ids, torch.tensor([8]), torch.tensor([[6]]), torch.ones(1, 1, dtype=torch.bool), bs, 0)
    assert short.labels.tolist() == [[IGNORE, 107, IGNORE, IGNORE]]
    assert torch.equal(blocks.ctx_mask(T), blocks.dense_mask(T)[:, :, :T])


def test_anchors_are_response_tokens_with_a_label():
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors([5, 3], [12, 40], 4, g)
    assert valid.all() and anchors.shape == (2, 4)
    assert all(5 <= a <= 10 for a in anchors[0].tolist()) and all(3 <= a <= 38 for a in anchors[1].tolist())
    anchors, valid = sample_anchors([5], [8], 16, g)   # only 5 and 6 leave room for a label
    assert anchors[0, valid[0]].tolist() == [5, 6]


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_train_forward_matches_inference_drafter(tiny, tmp_path, attention):
    tr = Trainer(tiny_config(tmp_path, draft_layers=2), target=tiny["target"], sequences=tiny["seqs"])
    d, seq = tr.drafter.eval(), tiny["seqs"][0]
    ids = torch.tensor([seq.ids])
    anchors = torch.tensor([[seq.prompt_len, len(seq.ids) - 3]])
    blocks = build_blocks(ids, torch.tensor([len(seq.ids)]), anchors, torch.ones(1, 2, dtype=torch.bool), 4, V - 1)
    feats = tr.features(ids)
    m = d.cfg.model
    with torch.no_grad():
        hidden = drafter_train_forward(d, feats, blocks, attention)
        for n, a in enumerate(anchors[0].tolist()):
            kv = KVCache.allocate(m.num_layers, 1, a + 4, m.num_kv_heads, m.head_dim, torch.float32, "cpu")
            ctx_pos, block_pos = torch.arange(a)[None], a + torch.arange(4)[None]
            meta = attn_meta(torch.tensor([a]), torch.ones(1, 4, 4, dtype=torch.bool), a + 4,
                             slots=torch.cat([ctx_pos, block_pos], dim=1))
            ref = d(blocks.ids[:, 4 * n:4 * n + 4], block_pos, feats[:, :a], ctx_pos, meta, kv.k, kv.v)
            torch.testing.assert_close(hidden[:, 4 * n:4 * n + 4], ref, atol=1e-5, rtol=1e-5)


def test_the_engine_accepts_what_the_training_forward_predicts(tiny, tmp_path):
    """Walk each greedy output with the training forward: a block at the anchor where a round
    would start, then on by the drafted tokens it got right plus the bonus. The engine's DFlash
    rounds accept exactly those lengths, round for round: the drafter decodes as it was trained
    (context features, positions, masks, the paged context writes)."""
    from drafttree.llm import LLM
    from drafttree.sampling import SamplingParams

    Trainer(tiny_config(tmp_path / "a", max_steps=40), target=tiny["target"], sequences=tiny["seqs"]).run()
    path = tmp_path / "a" / "drafter"
    d = load_drafter(path, tiny["target"], torch.float32, torch.device("cpu"))
    bs, prompts = d.cfg.block_size, tiny["prompts"][:6]
    # the chain in every round (budget fixed, no schedule): auto would decode plainly where drafting does not pay
    outs = LLM(model=str(tiny["target_dir"]), draft_model=str(path), spec="dflash", budget=1, budget_schedule="none",
               device="cpu", max_num_seqs=3).generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    features = FeatureExtractor(tiny["target"], d.cfg.target_layer_ids)
    drafted = 0
    for p, o in zip(prompts, outs):
        ids, P = torch.tensor([p + o.token_ids]), len(p)
        anchors = torch.arange(P, ids.shape[1] - 1)[None]
        blocks = build_blocks(ids, torch.tensor([ids.shape[1]]), anchors, torch.ones_like(anchors, dtype=torch.bool),
                              bs, d.cfg.mask_token_id)
        with torch.no_grad():
            hidden = drafter_train_forward(d, features(ids), blocks, "dense")
            pred = tiny["target"].lm_head(hidden).argmax(-1).view(-1, bs)[:, 1:]
        labels = blocks.labels.view(-1, bs)[:, 1:]
        lead = ((pred == labels) & (labels != IGNORE)).long().cumprod(1).sum(1).tolist()
        walk, a = [], 0
        while a < len(lead):
            walk.append(lead[a] + 1)
            a += lead[a] + 1
        got = o.metrics["accept_lengths"]
        assert sum(got) == len(o.token_ids) - 1 and got[:-1] == walk[:len(got) - 1], (walk, got)
        drafted += sum(k - 1 for k in got)
    assert drafted > 10   # the drafter was right often enough for the walk to mean something


def test_loss_falls_on_a_fixed_batch(tiny, tmp_path):
    tr = Trainer(tiny_config(tmp_path), target=tiny["target"], sequences=tiny["seqs"])
    losses = [float(tr.train_step(list(range(8)))[0].loss.detach()) for _ in range(25)]
    assert losses[-1] < 0.7 * losses[0]


def test_regeneration_resumes_and_matches_the_engine(tiny):
    path = tiny["root"] / "responses.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == len(tiny["prompts"])
    regenerate(tiny["prompts"], path, tiny["regen"], progress=False)     # all done: nothing added
    assert path.read_text().splitlines() == lines
    cut = tiny["root"] / "cut.jsonl"                                      # interrupted at once, then resumed
    regenerate(tiny["prompts"], cut, RegenConfig(**{**vars(tiny["regen"]), "time_limit": 0.0}), progress=False)
    assert len(cut.read_text().splitlines()) < len(lines)
    regenerate(tiny["prompts"], cut, tiny["regen"], progress=False)
    by_i = lambda text: sorted(text.splitlines(), key=lambda ln: json.loads(ln)["i"])
    assert by_i(cut.read_text()) == by_i(path.read_text())
    rec = json.loads(lines[0])
    from drafttree.sampling import SamplingParams
    from drafttree.train.regen import make_llm
    out = make_llm(tiny["regen"]).generate(rec["prompt_ids"], SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.token_ids == rec["response_ids"] and rec["prompt_ids"] == tiny["prompts"][rec["i"]]


def test_regeneration_shards_cover_the_prompts_once(tiny, tmp_path):
    parts = [regenerate(tiny["prompts"], tmp_path / f"s{k}.jsonl", tiny["regen"], progress=False, shard=(k, 3))
             for k in range(3)]
    recs = [json.loads(ln) for p in parts for ln in p.read_text().splitlines()]
    assert sorted(r["i"] for r in recs) == list(range(len(tiny["prompts"])))
    whole = {json.loads(ln)["i"]: json.loads(ln) for ln in (tiny["root"] / "responses.jsonl").read_text().splitlines()}
    assert all(r == whole[r["i"]] for r in recs)


def test_saved_drafter_loads_and_decodes_losslessly(tiny, tmp_path):
    from drafttree.llm import LLM
    from drafttree.sampling import SamplingParams

    tr = Trainer(tiny_config(tmp_path, max_steps=10, save_dtype="bf16"), target=tiny["target"],
                 sequences=tiny["seqs"])
    tr.run()
    out = tmp_path / "drafter"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 2]}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight",
            "layers.0.self_attn.k_norm.weight"} <= names and not any("qkv" in n or "embed" in n for n in names)
    d = load_drafter(out, tiny["target"], torch.float32, torch.device("cpu"))
    torch.testing.assert_close(d.fc.weight, tr.drafter.fc.weight.detach().bfloat16().float())
    prompts = tiny["prompts"][:4]
    sp = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(model=str(tiny["target_dir"]), device="cpu", max_num_seqs=4).generate(prompts, sp)
    spec = LLM(model=str(tiny["target_dir"]), draft_model=str(out), spec="dflash", device="cpu",
               max_num_seqs=4).generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_init_from_drafter_continues_a_published_drafter(tiny, tmp_path):
    """Training can start from a saved drafter (its config and weights), e.g. the shipped one."""
    first = Trainer(tiny_config(tmp_path / "a", draft_layers=2, max_steps=30), target=tiny["target"],
                    sequences=tiny["seqs"])
    first.run()
    cfg = json.loads((tmp_path / "a" / "drafter" / "config.json").read_text())
    cfg.update(ddtree_default_budget=4, ddtree_default_budget_schedule="16:0", ddtree_default_speculate_sampled=False)
    (tmp_path / "a" / "drafter" / "config.json").write_text(json.dumps(cfg))
    warm = Trainer(tiny_config(tmp_path / "b", draft_layers=1, init_from_drafter=tmp_path / "a" / "drafter"),
                   target=tiny["target"], sequences=tiny["seqs"])
    assert len(warm.drafter.layers) == len(first.drafter.layers) != 1       # the drafter's shape wins
    assert not [k for k in warm.config_dict if k.startswith("ddtree_default_")]   # measured for the old weights
    for (name, a), b in zip(first.drafter.state_dict().items(), warm.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    cold = Trainer(tiny_config(tmp_path / "c"), target=tiny["target"], sequences=tiny["seqs"])
    batch = list(range(8))
    assert float(warm.train_step(batch)[0].loss.detach()) < 0.9 * float(cold.train_step(batch)[0].loss.detach())


def test_a_published_drafter_retrains_at_another_block_size(tiny, tmp_path):
    """--block-size with --init-from-drafter keeps the weights (they hold no block size) and trains
    and saves blocks of the new width; the drafter then decodes losslessly at that width."""
    from drafttree.llm import LLM
    from drafttree.sampling import SamplingParams

    Trainer(tiny_config(tmp_path / "a", block_size=4, max_steps=10), target=tiny["target"],
            sequences=tiny["seqs"]).run()
    src = tmp_path / "a" / "drafter"
    kept = Trainer(tiny_config(tmp_path / "b", block_size=None, init_from_drafter=src), target=tiny["target"],
                   sequences=tiny["seqs"])
    assert kept.dcfg.block_size == 4
    wide = Trainer(tiny_config(tmp_path / "c", block_size=6, init_from_drafter=src, max_steps=2),
                   target=tiny["target"], sequences=tiny["seqs"])
    assert wide.dcfg.block_size == 6 and wide.pos_weights.shape == (6,)
    for a, b in zip(kept.drafter.state_dict().values(), wide.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    wide.run()
    assert json.loads((tmp_path / "c" / "drafter" / "config.json").read_text())["block_size"] == 6
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        Trainer(tiny_config(tmp_path / "d", block_size=1, init_from_drafter=src), target=tiny["target"],
                sequences=tiny["seqs"])
    with pytest.raises(ValueError, match="loop_keep must be"):
        Trainer(tiny_config(tmp_path / "e", loop_keep=-1), target=tiny["target"], sequences=tiny["seqs"])
    with pytest.raises(ValueError, match="snapshot_every and save_every are step counts"):
        Trainer(tiny_config(tmp_path / "f", snapshot_every=-5), target=tiny["target"], sequences=tiny["seqs"])
    prompts = tiny["prompts"][:3]
    sp = SamplingParams(temperature=0, max_tokens=16)
    plain = LLM(model=str(tiny["target_dir"]), device="cpu", max_num_seqs=3).generate(prompts, sp)
    llm = LLM(model=str(tiny["target_dir"]), draft_model=str(tmp_path / "c" / "drafter"), spec="dflash",
              device="cpu", max_num_seqs=3)
    assert llm.engine.spec.block_size == 6
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in plain]


def test_snapshots_give_a_tau_curve_against_training_tokens(tiny, tmp_path):
    """--snapshot-every N saves the drafter every N steps and at the last one, each with the step
    and the response tokens trained on; `eval --snapshots` measures τ of each in step order and
    writes the curve (JSON and PNG)."""
    seqs = tiny["seqs"]
    tr = Trainer(tiny_config(tmp_path, max_steps=30, snapshot_every=12, lr=3e-3), target=tiny["target"],
                 sequences=seqs)
    tr.run()
    snaps = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert snaps == ["step000012", "step000024", "step000030"]
    metas = [json.loads((tmp_path / "snapshots" / n / "snapshot.json").read_text()) for n in snaps]
    assert [m["step"] for m in metas] == [12, 24, 30]
    assert 0 < metas[0]["tokens"] < metas[1]["tokens"] < metas[2]["tokens"] == tr.tokens
    per_epoch = sum(s.response_len for s in seqs)
    assert tr.tokens == pytest.approx(30 * 8 / len(seqs) * per_epoch, rel=0.5)   # 8 sequences a step
    path = tmp_path / "eval.jsonl"
    write_prompts(path, tiny["prompts"][:3])
    assert main(["eval", "--out", str(tmp_path), "--target", str(tiny["target_dir"]), "--device", "cpu",
                 "--eval-prompts", str(path), "--eval-num", "3", "--eval-max-tokens", "12", "--snapshots",
                 "--methods", "dflash,ddtree", "--budgets", "4", "--temperatures", "0,1",
                 "--max-prompt-tokens", "16", "--quiet"]) == 0
    rows = json.loads((tmp_path / "tau_curve.json").read_text())
    assert [r["step"] for r in rows] == [12, 24, 30] and all(r["generated_tokens"] == 36 for r in rows)
    assert all(list(r["cells"]) == ["dflash T=0", "dflash T=1", "ddtree4 T=0", "ddtree4 T=1"] for r in rows)
    assert all(r["tau"] == pytest.approx(r["cells"]["dflash T=0"], abs=1e-4) for r in rows)
    assert all(v >= 1 for r in rows for v in r["cells"].values()) and (tmp_path / "tau_curve.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no snapshots"):
        main(["eval", "--out", str(tmp_path / "none"), "--target", str(tiny["target_dir"]), "--device", "cpu",
              "--eval-prompts", str(path), "--eval-num", "1", "--snapshots", "--quiet"])


def test_tau_is_measured_with_the_chain_in_every_round(tiny, tmp_path):
    """A drafter config's budget schedule ('1:0': plain rounds from one row on) must not turn the
    τ measurement into plain decoding: every round drafts."""
    from drafttree.train.evaluate import measure_tau

    Trainer(tiny_config(tmp_path / "a", max_steps=2), target=tiny["target"], sequences=tiny["seqs"]).run()
    drafter = tmp_path / "a" / "drafter"
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps(dict(cfg, ddtree_default_budget_schedule="1:0")))
    res = measure_tau(drafter, tiny["prompts"][:3], tiny["regen"], max_tokens=12)
    assert res["generated_tokens"] == 36 and sum(res["budget_histogram"].values()) > 0
    assert "0" not in res["budget_histogram"], res["budget_histogram"]


def test_tau_cells_cover_methods_budgets_and_temperatures(tiny, tmp_path):
    """`measure_cells`: the DFlash chain and DDTree budgets at T = 0 and T = 1, every round drafting
    (the chain its whole block, the tree its budget); every output equals plain decoding's (at T = 1 too: each request has a
    seed); the tree accepts at least the chain at T = 0; bad cells are refused."""
    from drafttree.train.evaluate import Cell, cells_of, measure_cells

    Trainer(tiny_config(tmp_path / "a", max_steps=40), target=tiny["target"], sequences=tiny["seqs"]).run()
    cells = cells_of(["dflash", "ddtree"], [2, 6], [0.0, 1.0])
    assert [c.label for c in cells] == ["dflash T=0", "dflash T=1", "ddtree2 T=0", "ddtree2 T=1",
                                        "ddtree6 T=0", "ddtree6 T=1"]
    res = measure_cells(tmp_path / "a" / "drafter", tiny["prompts"][:4], tiny["regen"], cells, max_tokens=16,
                        compare_plain=True)
    assert list(res) == [c.label for c in cells]
    for c in cells:
        r = res[c.label]
        assert r["mismatches"] == 0 and r["generated_tokens"] == 64 and r["tau"] >= 1, (c, r)
        assert (r["method"], r["budget"], r["temperature"]) == (c.method, c.budget, c.temperature)
        drafted = r["block_size"] - 1 if c.method == "dflash" else c.budget   # the chain: the whole block
        assert set(r["budget_histogram"]) == {str(drafted)}, r["budget_histogram"]
    assert res["ddtree6 T=0"]["tau"] >= res["dflash T=0"]["tau"] > 1
    with pytest.raises(ValueError, match="method"):
        Cell("eagle")
    with pytest.raises(ValueError, match="budget"):
        Cell("dflash", 4)
    with pytest.raises(ValueError, match="no τ cell"):
        cells_of(["ddtree"], [], [0.0])
    with pytest.raises(SystemExit, match="method must be"):
        main(["eval", "--out", str(tmp_path), "--target", str(tiny["target_dir"]), "--device", "cpu",
              "--eval-prompts", str(write_prompts(tmp_path / "e.jsonl", tiny["prompts"][:1])), "--eval-num", "1",
              "--methods", "dflash,medusa", "--quiet"])
    with pytest.raises(SystemExit, match="temperature must be"):   # before training, not after it
        main(["train", "--out", str(tmp_path / "t"), "--target", str(tiny["target_dir"]), "--device", "cpu",
              "--data", str(tiny["root"] / "responses.jsonl"), "--temperatures", "0,-1", "--quiet"])
    assert not (tmp_path / "t").exists()


def test_init_from_target_copies_its_last_layers(tiny, tmp_path):
    """--init-from-target: draft layer i starts as target layer L - n + i (norms, attention, the
    first MLP units when the drafter's MLP is narrower), the final norm as the target's."""
    from drafttree.train.model import new_drafter

    target = tiny["target"]
    cfg = Trainer(tiny_config(tmp_path, draft_layers=2, intermediate_size=32), target=target,
                  sequences=tiny["seqs"]).dcfg
    d = new_drafter(cfg, target, init_from_target=True)
    L, inter = len(target.layers), d.layers[0].mlp.down_proj.weight.shape[1]
    assert inter < target.layers[0].mlp.down_proj.weight.shape[1]
    torch.testing.assert_close(d.norm.weight, target.norm.weight, atol=0, rtol=0)
    for i, dst in enumerate(d.layers):
        src = target.layers[L - 2 + i]
        for name in ("input_layernorm", "post_attention_layernorm"):
            torch.testing.assert_close(getattr(dst, name).weight, getattr(src, name).weight, atol=0, rtol=0)
        for name in ("qkv_proj", "o_proj"):
            torch.testing.assert_close(getattr(dst.self_attn, name).weight, getattr(src.self_attn, name).weight,
                                       atol=0, rtol=0)
        torch.testing.assert_close(dst.mlp.down_proj.weight, src.mlp.down_proj.weight[:, :inter], atol=0, rtol=0)


def test_a_grown_drafter_starts_where_the_old_one_was(tiny, tmp_path):
    """Growing a trained drafter (2 -> 3 layers, MLP 64 -> 96) changes nothing it computes: the
    same batch gives the same loss; the new layer's and units' output projections start at zero
    and are the ones the first step moves; the grown drafter saves, loads and decodes losslessly."""
    from drafttree.llm import LLM
    from drafttree.sampling import SamplingParams

    first = Trainer(tiny_config(tmp_path / "a", draft_layers=2, max_steps=20), target=tiny["target"],
                    sequences=tiny["seqs"])
    first.run()
    src = tmp_path / "a" / "drafter"
    same = Trainer(tiny_config(tmp_path / "b", init_from_drafter=src, seed=3), target=tiny["target"],
                   sequences=tiny["seqs"])
    grown = Trainer(tiny_config(tmp_path / "c", init_from_drafter=src, seed=3, grow_layers=3, grow_intermediate=96),
                    target=tiny["target"], sequences=tiny["seqs"])
    assert (grown.config_dict["num_hidden_layers"], grown.config_dict["intermediate_size"]) == (3, 96)
    assert len(grown.drafter.layers) == 3 and grown.drafter.layers[0].mlp.down_proj.weight.shape[1] == 96
    new = grown.drafter.layers[2]
    assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
    assert not grown.drafter.layers[0].mlp.down_proj.weight[:, 64:].any()
    batch = list(range(8))
    a, b = same.train_step(batch)[0].loss.item(), grown.train_step(batch)[0].loss.item()
    assert b == pytest.approx(a, rel=1e-5)
    assert new.self_attn.o_proj.weight.any() and grown.drafter.layers[0].mlp.down_proj.weight[:, 64:].any()
    grown.cfg.max_steps = grown.total_steps = 2
    grown.run()
    prompts = tiny["prompts"][:3]
    sp = SamplingParams(temperature=0, max_tokens=16)
    plain = LLM(model=str(tiny["target_dir"]), device="cpu", max_num_seqs=3).generate(prompts, sp)
    spec = LLM(model=str(tiny["target_dir"]), draft_model=str(tmp_path / "c" / "drafter"), spec="dflash",
               device="cpu", max_num_seqs=3).generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    with pytest.raises(ValueError, match="only grows"):
        Trainer(tiny_config(tmp_path / "d", init_from_drafter=src, grow_layers=1), target=tiny["target"],
                sequences=tiny["seqs"])
    with pytest.raises(ValueError, match="needs init_from_drafter"):
        Trainer(tiny_config(tmp_path / "e", grow_layers=4), target=tiny["target"], sequences=tiny["seqs"])


def test_checkpoint_resume_continues_to_the_same_weights(tiny, tmp_path):
    seqs = tiny["seqs"][:24]
    ref = Trainer(tiny_config(tmp_path / "ref", epochs=2, log_every=2), target=tiny["target"], sequences=seqs)
    ref.run()
    assert ref.step == 6
    first = Trainer(tiny_config(tmp_path / "cut", epochs=2, log_every=2, stop_at=4), target=tiny["target"], sequences=seqs)
    first.run()
    assert first.step == 4 and (tmp_path / "cut" / "checkpoints" / "last.pt").is_file()
    curve = tmp_path / "cut" / "train_curve.png"   # drawn with the checkpoint
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = Trainer(tiny_config(tmp_path / "cut", epochs=2, log_every=2, resume=True), target=tiny["target"], sequences=seqs)
    assert again.step == 4 and again.tokens == first.tokens > 0
    again.run()
    assert again.step == 6 and again.tokens == ref.tokens
    for (name, a), b in zip(ref.drafter.state_dict().items(), again.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert [h["step"] for h in again.history] == [h["step"] for h in ref.history]


def test_cli_training_raises_tau_in_the_real_decoder(tiny, tmp_path):
    """Train through the CLI on the target's own greedy outputs; decode the training prompts
    with the real DFlash loop: τ must beat the untrained drafter's (an off-by-one would not)."""
    data = tiny["root"] / "responses.jsonl"
    eval_prompts = write_prompts(tmp_path / "eval.jsonl", tiny["prompts"][:6])
    common = ["--target", str(tiny["target_dir"]), "--device", "cpu", "--data", str(data), "--block-size", "4",
              "--draft-layers", "1", "--intermediate-size", "64", "--num-target-features", "2",
              "--mask-token-id", str(V - 1), "--anchors-per-seq", "64", "--batch-size", "8", "--lr", "3e-3",
              "--eval-prompts", str(eval_prompts), "--eval-num", "6", "--eval-max-tokens", "40",
              "--max-prompt-tokens", "16", "--compare-plain", "--quiet"]
    assert main(["train", "--out", str(tmp_path / "init"), "--max-steps", "0", *common]) == 0
    assert main(["train", "--out", str(tmp_path / "trained"), "--epochs", "30", "--max-steps", "150",
                 *common]) == 0
    init = json.loads((tmp_path / "init" / "train_log.json").read_text())["eval"]
    log = json.loads((tmp_path / "trained" / "train_log.json").read_text())
    assert log["eval"]["mismatches"] == 0 and init["mismatches"] == 0
    assert log["history"][-1]["loss"] < log["history"][0]["loss"]
    assert log["eval"]["tau"] > init["tau"] + 0.15, (init["tau"], log["eval"]["tau"])


def test_prompt_files_and_truncated_sharegpt(tmp_path):
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": "answer"}]} for i in range(60)]
    text = json.dumps(recs)
    cut = text[:text.rindex('{"id"') + 20]                # the last record is cut off
    assert len(list(iter_json_array(cut))) == 59
    f = tmp_path / "sharegpt.json"
    f.write_text(cut)
    train, heldout = load_sharegpt_prompts(limit=10, seed=1, eval_size=5, path=f)
    train_all, heldout2 = load_sharegpt_prompts(seed=1, eval_size=5, path=f)
    assert len(train) == 10 and heldout == heldout2 and len(train_all) == 54
    assert not set(heldout) & set(train_all)
    p = write_prompts(tmp_path / "p.jsonl", ["hello", [1, 2, 3]])
    assert read_prompts(p) == ["hello", [1, 2, 3]]
    p.write_text(p.read_text() + '{"prompt": "cut\n')      # a record split across lines
    with pytest.raises(ValueError, match=r"p\.jsonl:3: not JSON"):
        read_prompts(p)
    seqs = [TrainSequence([1, 2, 3, 4], 1), TrainSequence([5, 6, 7], 2), TrainSequence([8, 9, 10, 11, 12], 2)]
    back = read_sequences(write_sequences(tmp_path / "s.jsonl", seqs), max_len=4)
    assert back == [seqs[0], TrainSequence([8, 9, 10, 11], 2)]   # one response token: no anchor fits


def test_a_closing_loop_is_found_and_cut_to_a_few_periods(tmp_path):
    head = list(range(100, 160))
    cycle = [7, 8, 9, 10, 11]
    looped = head + cycle * 20                               # 100 tokens of a period-5 loop
    assert closing_loop(looped) == (60, 5)                   # not 10 or 15, which hold from 60 too
    assert closing_loop(head + [3] * 60) == (60, 1)
    assert closing_loop(head + [7, 8] * 10 + [1]) is None     # stopped: it does not end in a loop
    assert closing_loop(head + cycle * 4) is None             # 20 tokens: too short to call a loop
    # a cycle whose first tokens repeat a shorter pattern: the whole period is found
    assert closing_loop(head + [1, 2, 1, 2, 1, 3] * 12) == (60, 6)
    assert closing_loop(head + [4, 4, 4, 4] + cycle * 20)[0] == 64
    seqs = [TrainSequence([1, 2] + looped, 2), TrainSequence([1, 2] + head, 2)]
    path = write_sequences(tmp_path / "s.jsonl", seqs)
    assert read_sequences(path) == seqs
    assert read_sequences(path, loop_keep=2) == [TrainSequence([1, 2] + head + cycle * 2, 2), seqs[1]]
    assert read_sequences(path, loop_keep=0)[0].ids == [1, 2] + head


def test_sharegpt_conversations_keep_every_turn_and_the_prompts_split(tmp_path):
    long = "x" * 50
    recs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"},
                               {"from": "human", "value": f"q{i} again"}, {"from": "gpt", "value": "b"},
                               {"from": "human", "value": long if i % 3 == 0 else f"q{i} third"}]}
            for i in range(40)]
    recs.append({"conversations": [{"from": "human", "value": "q1"}]})   # a repeated first turn: dropped
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps(recs))
    train, heldout = load_sharegpt_conversations(seed=2, eval_size=4, max_chars=40, path=f)
    assert len(train) + len(heldout) == 40
    assert all(len(c.turns) == (2 if c.turns[0][1:] and int(c.turns[0][1:]) % 3 == 0 else 3) for c in train)
    firsts = load_sharegpt_prompts(seed=2, eval_size=4, max_chars=40, path=f)
    assert firsts == ([c.turns[0] for c in train], [c.turns[0] for c in heldout])   # the same split
    p = write_prompts(tmp_path / "c.jsonl", [train[0], Conversation(((1, 2), (3,)))])
    assert read_prompts(p) == [train[0], Conversation(((1, 2), (3,)))]


def test_conversations_are_answered_turn_by_turn_and_resume(tiny, tmp_path):
    """Token-id conversations: turn t's prompt is the turns and the target's replies before it,
    laid end to end; an interrupted run resumes to the same records."""
    convs = [Conversation(((1, 2, 3), (4, 5), (6,))), Conversation(((7, 8),)), Conversation(((9,), (10, 11)))]
    rc = RegenConfig(**{**vars(tiny["regen"]), "max_tokens": 6, "max_prompt_tokens": 32})
    path = regenerate(convs, tmp_path / "conv.jsonl", rc, progress=False)
    recs = {(r["i"], r["turn"]): r for r in map(json.loads, path.read_text().splitlines())}
    assert sorted(recs) == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]
    for (i, t), r in recs.items():
        context = [x for u in range(t) for x in [*convs[i].turns[u], *recs[i, u]["response_ids"]]]
        assert r["prompt_ids"] == context + list(convs[i].turns[t]) and len(r["response_ids"]) == 6
    from drafttree.sampling import SamplingParams
    from drafttree.train.regen import make_llm
    again = make_llm(rc).generate(recs[0, 2]["prompt_ids"], SamplingParams(temperature=0, max_tokens=6))[0]
    assert again.token_ids == recs[0, 2]["response_ids"]
    cut = tmp_path / "cut.jsonl"
    regenerate(convs, cut, RegenConfig(**{**vars(rc), "time_limit": 0.0}), progress=False)
    assert len(cut.read_text().splitlines()) < len(recs)
    regenerate(convs, cut, rc, progress=False)
    assert {(r["i"], r["turn"]): r for r in map(json.loads, cut.read_text().splitlines())} == recs
    seqs = read_sequences(path)
    assert len(seqs) == 6 and all(s.response_len == 6 for s in seqs)


def test_training_reads_several_sequence_files_in_order(tiny, tmp_path):
    half = len(tiny["seqs"]) // 2
    a = write_sequences(tmp_path / "a.jsonl", tiny["seqs"][:half])
    b = write_sequences(tmp_path / "b.jsonl", tiny["seqs"][half:])
    tr = Trainer(tiny_config(tmp_path / "run", data=[a, b]), target=tiny["target"])
    assert tr.seqs == tiny["seqs"]


def test_regeneration_on_every_gpu_writes_shards_that_training_reads(tiny, tmp_path, monkeypatch):
    """`--shard all` runs one process per GPU (two here, on the CPU), each its shard; training's
    default data is the shards, in order, and they hold every prompt once."""
    from drafttree.train.data import regenerated
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    prompts = write_prompts(tmp_path / "p.jsonl", tiny["prompts"][:6])
    assert main(["regenerate", "--out", str(tmp_path), "--target", str(tiny["target_dir"]), "--device", "cpu",
                 "--prompts", str(prompts), "--shard", "all", "--max-tokens", "5", "--max-prompt-tokens", "16",
                 "--quiet"]) == 0
    files = regenerated(tmp_path)
    assert [f.name for f in files] == ["responses.shard0of2.jsonl", "responses.shard1of2.jsonl"]
    recs = [json.loads(ln) for f in files for ln in f.read_text().splitlines()]
    assert sorted(r["i"] for r in recs) == list(range(6))


def test_shards_resume_what_one_process_began(tiny, tmp_path):
    """A regeneration cut short in one file, continued as two shards: each shard asks only what
    no file of the run holds (a later turn takes its context from the other file), and the files
    together hold each turn once, as one uninterrupted run does."""
    from drafttree.train.data import regenerated
    convs = [Conversation(((1, 2, 3), (4, 5), (6,))), Conversation(((7, 8), (9,))), Conversation(((10,),)),
             Conversation(((11, 12), (13,), (14, 15)))]
    rc = RegenConfig(**{**vars(tiny["regen"]), "max_tokens": 5, "max_prompt_tokens": 40})
    whole = {(r["i"], r["turn"]): r for r in
             map(json.loads, regenerate(convs, tmp_path / "one" / "responses.jsonl", rc, progress=False)
                 .read_text().splitlines())}
    run = tmp_path / "run"
    first = run / "responses.jsonl"
    first.parent.mkdir()
    first.write_text("".join(json.dumps(whole[k]) + "\n" for k in [(0, 0), (1, 0), (3, 0), (3, 1)]))
    for k in range(2):
        regenerate(convs, run / f"responses.shard{k}of2.jsonl", rc, progress=False, shard=(k, 2))
    files = regenerated(run)
    assert [f.name for f in files] == ["responses.jsonl", "responses.shard0of2.jsonl", "responses.shard1of2.jsonl"]
    recs = [json.loads(ln) for f in files for ln in f.read_text().splitlines()]
    keys = [(r["i"], r["turn"]) for r in recs]
    assert sorted(keys) == sorted(whole) and len(set(keys)) == len(keys)
    assert all(r == whole[r["i"], r["turn"]] for r in recs)
    assert {(r["i"], r["turn"]) for r in map(json.loads, files[1].read_text().splitlines())} == {(0, 1), (2, 0), (0, 2)}


def test_a_long_turn_ends_its_conversation(tiny, tmp_path):
    convs = [Conversation(((1, 2), tuple(range(1, 12)), (3,)))]   # turn 1 passes the 16-token limit
    path = regenerate(convs, tmp_path / "conv.jsonl", RegenConfig(**{**vars(tiny["regen"]), "max_tokens": 6}),
                      progress=False)
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(r["turn"], bool(r.get("skipped"))) for r in recs] == [(0, False), (1, True)]
    longer = RegenConfig(**{**vars(tiny["regen"]), "max_tokens": 6, "max_prompt_tokens": 40})
    regenerate(convs, path, longer, progress=False)    # a higher limit asks the skipped turn and the rest
    fresh = regenerate(convs, tmp_path / "fresh.jsonl", longer, progress=False)
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(r["turn"], bool(r.get("skipped"))) for r in recs] == [(0, False), (1, True), (1, False), (2, False)]
    assert recs[0:1] + recs[2:] == [json.loads(ln) for ln in fresh.read_text().splitlines()]
    assert [s.response_len for s in read_sequences(path)] == [6, 6, 6]


def test_time_limit_fits_the_schedule_to_the_clock(tiny, tmp_path):
    tr = Trainer(tiny_config(tmp_path, epochs=1000, time_limit=3.0), target=tiny["target"], sequences=tiny["seqs"])
    planned = tr.total_steps
    tr.run()
    assert tr.total_steps < planned and tr.step <= tr.total_steps
    assert tr.sched.get_last_lr()[0] < 0.2 * tr.cfg.lr      # the cosine ran (nearly) to its end


def test_time_limit_refits_when_early_steps_were_slow(tiny, tmp_path, monkeypatch):
    """The first 25 steps cost 0.4 s on a fake clock, later ones 0.25 s: the schedule fitted
    after them is too short, and a refit lengthens it, so the run ends near the time limit with
    its cosine done (the first fit alone once left 40 % of a GPU run's time unused)."""
    from drafttree.train import trainer as trainer_mod
    clock = [0.0]
    monkeypatch.setattr(trainer_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    tr = Trainer(tiny_config(tmp_path, epochs=1000, time_limit=80.0), target=tiny["target"], sequences=tiny["seqs"])
    step = tr.train_step

    def timed_step(idx):
        clock[0] += 0.4 if tr.step < 25 else 0.25
        return step(idx)
    monkeypatch.setattr(tr, "train_step", timed_step)
    fits = []
    monkeypatch.setattr(trainer_mod.log, "info", lambda msg, n, rate: fits.append(n))
    tr.run()
    assert len(fits) == 2 and fits[1] > fits[0]          # step 25's fit, then step 85's refit
    assert tr.step == tr.total_steps == fits[1] and clock[0] > 0.85 * 80.0
    assert tr.sched.get_last_lr()[0] < 0.01 * tr.cfg.lr


def test_time_limit_with_max_steps_stops_and_resumes(tiny, tmp_path):
    """With max_steps the schedule stays fixed: the clock only stops the run, and a resumed
    run carries on to the same end."""
    # half a second holds a few steps of this drafter (tens on a fast CPU), well short of 120
    cut = Trainer(tiny_config(tmp_path, max_steps=120, time_limit=0.5), target=tiny["target"], sequences=tiny["seqs"])
    cut.run()
    assert cut.total_steps == 120 and 0 < cut.step < 120
    assert cut.history[-1]["step"] == cut.step        # the steps after the last record are logged too
    again = Trainer(tiny_config(tmp_path, max_steps=120, resume=True), target=tiny["target"], sequences=tiny["seqs"])
    assert again.step == cut.step
    again.run()
    assert again.step == 120 and again.sched.get_last_lr()[0] == 0.0


def _rank_worker(rank: int, world: int, port: int, root: str, target_dir: str, out: str) -> None:
    import os

    from drafttree.train.parallel import close_group, init_group
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    group = init_group()
    cfg = tiny_config(Path(out), target=target_dir, max_steps=8, save_every=4)
    tr = Trainer(cfg, sequences=read_sequences(Path(root) / "responses.jsonl"), group=group)
    tr.run()
    flat = torch.cat([p.detach().flatten() for p in tr.drafter.parameters()])
    torch.save({"params": flat, "step": tr.step, "steps_per_epoch": tr.steps_per_epoch}, Path(out) / f"rank{rank}.pt")
    close_group(group)


def test_two_ranks_train_in_step(tiny, tmp_path):
    """Data-parallel training (gloo, two processes): each rank takes half the batches, the
    averaged gradients keep both drafters identical, and rank 0 writes the checkpoint."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp"
    mp.spawn(_rank_worker, args=(2, port, str(tiny["root"]), str(tiny["target_dir"]), str(out)), nprocs=2)
    r0, r1 = (torch.load(out / f"rank{k}.pt") for k in (0, 1))
    assert r0["step"] == r1["step"] == 8
    single = math.ceil(len(tiny["seqs"]) / 8)
    assert r0["steps_per_epoch"] == single // 2
    torch.testing.assert_close(r0["params"], r1["params"], atol=0, rtol=0)
    init = Trainer(tiny_config(tmp_path / "init", target=str(tiny["target_dir"])), sequences=tiny["seqs"])
    before = torch.cat([p.detach().flatten() for p in init.drafter.parameters()])
    assert not torch.equal(before, r0["params"])                     # it trained
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert ckpt["world"] == 2 and len(ckpt["rng"]["anchors"]) == 2 and ckpt["step"] == 8
    assert (out / "drafter" / "model.safetensors").is_file()


CODE = '''
import os


def public(a, b: int = 2) -> int:
    """Add a and b, then double the sum; a docstring long enough to count."""
    total = a + b
    return 2 * total


def _private(x):
    """A private helper whose docstring is long enough but whose name is not public."""
    return x


def short_doc(x):
    """Too short."""
    return x


class Box:
    def size(self) -> int:
        """The number of items in the box, counting nested boxes once each."""
        # a comment kept in the source
        return len(self.items)

    def only_doc(self):
        """A method whose body is nothing but this docstring,
        long enough to count."""
'''


def test_code_prompts_come_from_public_documented_functions(tmp_path):
    from drafttree.train.code_prompts import TASKS, code_prompts, code_units
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(CODE)
    (tmp_path / "pkg" / "tests").mkdir()
    (tmp_path / "pkg" / "tests" / "helpers.py").write_text(CODE)     # test folders are skipped
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")            # unparsable files too
    units = {u.name: u for u in code_units([tmp_path])}
    assert set(units) == {"public", "Box.size", "Box.only_doc"}
    pub = units["public"]
    assert pub.module == "pkg.mod" and pub.signature == "(a, b: int=2) -> int"
    assert pub.doc.startswith("Add a and b") and '"""' in pub.source and '"""' not in pub.bare
    assert pub.bare == "def public(a, b: int = 2) -> int:\n    total = a + b\n    return 2 * total"
    assert "# a comment kept in the source" in units["Box.size"].bare
    assert units["Box.only_doc"].bare.endswith("pass")
    prompts, counts = code_prompts(None, seed=3, roots=[tmp_path])
    assert len(prompts) == 3 and sum(counts.values()) == 3 and set(counts) == {t for t, _ in TASKS}
    assert code_prompts(None, seed=3, roots=[tmp_path]) == (prompts, counts)
    assert len(code_prompts(2, seed=3, roots=[tmp_path])[0]) == 2
    for p in prompts:   # each asks about one unit: its code, or (to write it) its name, signature and docstring
        assert sum(u.source in p or u.bare in p or (f"`{u.name}{u.signature}`" in p and u.doc in p)
                   for u in units.values()) == 1, p


def test_prompts_stage_mixes_code_into_the_training_prompts(tmp_path, monkeypatch):
    import drafttree.prompts as prompts
    f = tmp_path / "sharegpt.json"
    records = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "a"},
                                  {"from": "human", "value": f"follow-up {i}"}]} for i in range(12)]
    f.write_text(json.dumps(records))
    monkeypatch.setattr(prompts, "sharegpt_path", lambda: f)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mod.py").write_text(CODE)
    out = tmp_path / "run"
    assert main(["prompts", "--out", str(out), "--eval-size", "2", "--code-roots", str(tmp_path / "src")]) == 0
    train = read_prompts(out / "prompts_train.jsonl")
    convs = [p for p in train if isinstance(p, Conversation)]
    code = [p for p in train if isinstance(p, str)]
    assert len(convs) == 10 and len(code) == 3 and all("```python" in p or "Write a Python" in p for p in code)
    sources = json.loads((out / "prompt_sources.json").read_text())
    assert sources["sharegpt"]["prompts"] == 10 and sources["sharegpt"]["user_turns"] == 20
    assert sources["code"]["prompts"] == 3 and sources["heldout"]["prompts"] == 2
    held = read_prompts(out / "prompts_heldout.jsonl")
    assert len(held) == 2 and not set(held) & {c.turns[0] for c in convs}
    assert main(["prompts", "--out", str(tmp_path / "none"), "--code-prompts", "0"]) == 0
    assert all(isinstance(p, Conversation) for p in read_prompts(tmp_path / "none" / "prompts_train.jsonl"))
