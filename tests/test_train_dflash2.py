"""Training DFlash2 drafters and the distillation loss (`train-drafter --arch dflash2`, `--loss
kl`) on a tiny random target: the training forward against the inference drafter, the losses,
a DFlash drafter made DFlash2, the published checkpoint that comes out, and the refusals."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from drafttree import LLM, SamplingParams
from drafttree.loader.weights import load_target
from drafttree.models.kv_cache import KVCache, attn_meta
from drafttree.train.cli import main
from drafttree.train.data import read_sequences
from drafttree.train.forward import block_loss, drafter_train_forward
from drafttree.train.recipe import IGNORE, build_blocks, position_weights
from drafttree.train.regen import RegenConfig, regenerate
from drafttree.train.trainer import TrainConfig, Trainer
from tests.tiny import make_drafter, make_target

V = 32
SHAPE = {"arch": "dflash2", "conv_group_size": 4, "selector_rank": 8, "selector_top_k": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny sharp target and its own greedy answers to 16 token-id prompts."""
    root = tmp_path_factory.mktemp("train2")
    target_dir = make_target(root / "target", vocab=V, layers=4, scale=3.0)
    rng = random.Random(1)
    prompts = [[rng.randrange(V - 1) for _ in range(rng.randint(2, 6))] for _ in range(16)]
    rc = RegenConfig(target=str(target_dir), device="cpu", max_num_seqs=16, max_prompt_tokens=16, max_tokens=32)
    regenerate(prompts, root / "responses.jsonl", rc, progress=False)
    target, _ = load_target(target_dir, torch.float32, "cpu")
    return {"root": root, "target_dir": target_dir, "target": target, "prompts": prompts,
            "seqs": read_sequences(root / "responses.jsonl")}


def config(out, **kw) -> TrainConfig:
    base = {"out": out, "device": "cpu", "block_size": 4, "draft_layers": 1, "intermediate_size": 64,
            "num_target_features": 2, "anchors_per_seq": 32, "batch_size": 8, "epochs": 100, "lr": 3e-3,
            "mask_token_id": V - 1, "progress": False, "log_every": 5, "save_dtype": "fp32"}
    return TrainConfig(**{**base, **kw})


def trainer(tiny, out, **kw) -> Trainer:
    return Trainer(config(out, **kw), target=tiny["target"], sequences=tiny["seqs"])


@pytest.mark.parametrize("attention,window", [("dense", None), ("blockwise", None), ("dense", 5), ("blockwise", 5)])
def test_train_forward_matches_inference_drafter(tiny, tmp_path, attention, window):
    """Blocks side by side in one training forward give the inference drafter's hidden states
    block by block: each block's convolutions stay inside it (taps and coefficients made
    random here, not the identity training starts from), and a window narrows the context."""
    tr = trainer(tiny, tmp_path, draft_layers=2, **SHAPE)
    d = tr.drafter.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in d.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn(conv.base_kernel.shape, generator=g) * 0.3)
                conv.kernel_projection.weight.normal_(0, 0.3, generator=g)
    d.cfg.sliding_window = window
    seq = tiny["seqs"][0]
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


def test_kl_loss_is_the_divergence_to_the_target(tiny, tmp_path):
    """`--loss kl`: at each label, KL(target || drafter) of the distributions over the vocabulary,
    the target's taken where it predicts that label (the position before)."""
    tr = trainer(tiny, tmp_path)
    seq = tiny["seqs"][1]
    ids = torch.tensor([seq.ids])
    anchors = torch.tensor([[seq.prompt_len, seq.prompt_len + 2]])
    blocks = build_blocks(ids, torch.tensor([len(seq.ids)]), anchors, torch.ones(1, 2, dtype=torch.bool), 4, V - 1)
    feats, final = tr.features.with_final(ids)
    w = position_weights(4, 4.0)
    with torch.no_grad():
        hidden = drafter_train_forward(tr.drafter, feats, blocks, "dense")
        got = block_loss(hidden, blocks, tiny["target"].lm_head, w, teacher=final).loss
        num = den = 0.0
        for j in range(blocks.labels.shape[1]):
            if blocks.labels[0, j] == IGNORE:
                continue
            p = tiny["target"].lm_head(final[0, blocks.pos[0, j] - 1]).log_softmax(-1)
            q = tiny["target"].lm_head(hidden[0, j]).log_softmax(-1)
            num += w[j % 4] * (p.exp() * (p - q)).sum()
            den += w[j % 4]
    assert abs(float(got) - float(num / den)) < 1e-5
    # and the labels are the target's own greedy tokens here, so the target puts most mass on them
    assert float(got) < float(block_loss(hidden, blocks, tiny["target"].lm_head, w).loss)


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_losses_fall_on_a_fixed_batch(tiny, tmp_path, loss):
    tr = trainer(tiny, tmp_path, loss=loss, **SHAPE)
    outs = [tr.train_step(list(range(8)))[0] for _ in range(25)]
    assert float(outs[-1].loss.detach()) < 0.7 * float(outs[0].loss.detach())
    assert float(outs[-1].selector) < 0.8 * float(outs[0].selector)   # the selector learns too


def test_trained_dflash2_saves_loads_and_decodes_losslessly(tiny, tmp_path):
    tr = trainer(tiny, tmp_path, max_steps=10, save_dtype="bf16", **SHAPE)
    summary = tr.run()
    assert "selector_loss" in summary["history"][-1]
    out = tmp_path / "drafter"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 2], "conv_kernel_size": 2,
                                    "conv_group_size": 4, "selector_rank": 8, "selector_top_k": 4}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        n_params = sum(f.get_tensor(k).numel() for k in names)
    assert {"layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert summary["parameters"] == n_params
    prompts = tiny["prompts"][:3]
    sp = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0.8, seed=3, max_tokens=20),
          SamplingParams(temperature=0, max_tokens=20)]
    plain = [o.token_ids for o in
             LLM(model=str(tiny["target_dir"]), device="cpu", max_num_seqs=3).generate(prompts, sp)]
    for spec, budget in (("dflash", 1), ("ddtree", 6)):
        llm = LLM(model=str(tiny["target_dir"]), draft_model=str(out), spec=spec, budget=budget, device="cpu",
                  max_num_seqs=3)
        assert type(llm.engine.runner.drafter).__name__ == "DFlash2Drafter"
        assert [o.token_ids for o in llm.generate(prompts, sp)] == plain, spec


def test_a_dflash_drafter_becomes_dflash2_where_it_was(tiny, tmp_path):
    """--arch dflash2 from a DFlash drafter: its weights, the convolutions the identity and a
    fresh selector, so the unary loss starts exactly where the DFlash drafter's is."""
    src = make_drafter(tmp_path / "src", tiny["target_dir"], block_size=4, layers=1, target_layer_ids=[1, 2])
    old = trainer(tiny, tmp_path / "a", init_from_drafter=src, seed=2)
    new = trainer(tiny, tmp_path / "b", init_from_drafter=src, seed=2, arch="dflash2", conv_group_size=4,
                  selector_rank=8, selector_top_k=4)
    assert new.config_dict["architectures"] == ["DFlash2DraftModel"]
    assert new.dcfg.selector_rank == 8 and type(new.drafter).__name__ == "DFlash2Drafter"
    batch = list(range(8))
    a, b = old.train_step(batch)[0], new.train_step(batch)[0]
    assert float(b.loss.detach() - b.selector) == pytest.approx(float(a.loss.detach()), rel=1e-5)
    assert b.selector > 0


def test_a_dflash2_run_resumes_with_its_own_flags(tiny, tmp_path):
    """--resume with the flags the run began with (its shape among them) continues it."""
    seqs = tiny["seqs"][:8]
    first = Trainer(config(tmp_path, epochs=4, stop_at=2, **SHAPE), target=tiny["target"], sequences=seqs)
    first.run()
    again = Trainer(config(tmp_path, epochs=4, resume=True, **SHAPE), target=tiny["target"], sequences=seqs)
    assert again.step == 2 and type(again.drafter).__name__ == "DFlash2Drafter"
    for (name, a), b in zip(first.drafter.state_dict().items(), again.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    with pytest.raises(ValueError, match="selector_rank shape a new DFlash2 drafter"):
        Trainer(config(tmp_path, epochs=4, resume=True, **{**SHAPE, "selector_rank": 16}), target=tiny["target"],
                sequences=seqs)


def test_bad_training_options_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="selector_rank shape a new DFlash2 drafter"):
        trainer(tiny, tmp_path / "a", selector_rank=8)
    with pytest.raises(ValueError, match="selector_loss_weight is DFlash2's"):
        trainer(tiny, tmp_path / "b", selector_loss_weight=0.5)
    with pytest.raises(ValueError, match="loss must be one of"):
        trainer(tiny, tmp_path / "c", loss="mse")
    with pytest.raises(ValueError, match="arch must be one of"):
        trainer(tiny, tmp_path / "d", arch="eagle")
    with pytest.raises(ValueError, match="conv_group_size 5 must divide hidden_size 48"):
        trainer(tiny, tmp_path / "e", **{**SHAPE, "conv_group_size": 5})
    d2 = make_drafter(tmp_path / "d2", tiny["target_dir"], block_size=4, layers=1, target_layer_ids=[1, 2],
                      arch="dflash2")
    with pytest.raises(ValueError, match="a DFlash2 drafter does not become DFlash"):
        trainer(tiny, tmp_path / "f", init_from_drafter=d2, arch="dflash")
    with pytest.raises(ValueError, match="with its own shape"):
        trainer(tiny, tmp_path / "g", init_from_drafter=d2, selector_top_k=2)
    cfg = json.loads((d2 / "config.json").read_text())
    (d2 / "config.json").write_text(json.dumps({**cfg, "is_causal": True}))
    with pytest.raises(ValueError, match="causal DFlash2 drafter"):
        trainer(tiny, tmp_path / "h", init_from_drafter=d2)


def test_cli_trains_dflash2_with_distillation(tiny, tmp_path):
    """The flags reach the trainer: a DFlash2 drafter of the asked shape, trained with --loss kl."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--target", str(tiny["target_dir"]), "--device", "cpu",
                 "--data", str(tiny["root"] / "responses.jsonl"), "--block-size", "4", "--draft-layers", "1",
                 "--intermediate-size", "64", "--num-target-features", "2", "--mask-token-id", str(V - 1),
                 "--anchors-per-seq", "16", "--max-steps", "3", "--eval-num", "0", "--quiet", "--arch", "dflash2",
                 "--conv-kernel-size", "3", "--conv-group-size", "8", "--selector-rank", "4", "--selector-top-k", "5",
                 "--selector-loss-weight", "0.5", "--loss", "kl"]) == 0
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 3, "conv_group_size": 8,
                                                                        "selector_rank": 4, "selector_top_k": 5}
    log = json.loads((out / "train_log.json").read_text())
    assert log["train_config"]["loss"] == "kl" and log["train_config"]["selector_loss_weight"] == 0.5
    assert log["step"] == 3
