"""Loading DFlash drafters in the published format: what fits is used as written, what does
not fit is refused with a message that names the mismatch."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from drafttree import LLM, SamplingParams
from drafttree.models.dflash import DFlashConfig
from tests.helpers import ref_rms, ref_rope
from tests.tiny import copy_checkpoint, edit_config, edit_tensors, make_drafter, make_target

VOCAB = 31
LAYERS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target") / "llama", "llama", vocab=VOCAB, layers=LAYERS)


@pytest.fixture(scope="module")
def good_drafter(target, tmp_path_factory):
    return make_drafter(tmp_path_factory.mktemp("drafter") / "good", target, block_size=4)


def build(target, drafter, **kw) -> LLM:
    kw.setdefault("spec", "dflash")
    if kw["spec"] == "dflash":
        kw.setdefault("budget", 1)   # the chain in every round (auto may decode plainly instead)
    return LLM(model=str(target), draft_model=None if drafter is None else str(drafter), device="cpu",
               dtype="float32", max_num_seqs=2, max_model_len=64, **kw)


# -- drafters that do not fit the target ------------------------------------------------------

def test_hidden_size_mismatch(target, tmp_path):
    d = make_drafter(tmp_path / "d", target, hidden=40)            # the target's hidden size is 48
    with pytest.raises(ValueError, match=r"hidden size 40 != target's 48"):
        build(target, d)


def test_vocab_mismatch(target, tmp_path):
    d = make_drafter(tmp_path / "d", target, vocab=VOCAB + 5)
    with pytest.raises(ValueError, match=rf"vocab size {VOCAB + 5} != target's {VOCAB}"):
        build(target, d)


@pytest.mark.parametrize("ids", [[0, LAYERS], [1, 7]])
def test_target_layer_ids_beyond_target(target, tmp_path, ids):
    d = make_drafter(tmp_path / "d", target, target_layer_ids=ids)
    with pytest.raises(ValueError, match=rf"target_layer_ids \[{ids[1]}\] not in \[0, {LAYERS}\)"):
        build(target, d, spec="ddtree")


def test_target_layer_ids_not_increasing(target, tmp_path):
    d = edit_config(make_drafter(tmp_path / "d", target), dflash_config={"target_layer_ids": [1, 0]})
    with pytest.raises(ValueError, match="strictly increasing"):
        build(target, d)


@pytest.mark.parametrize("mask", [VOCAB, VOCAB + 100, -1])
def test_mask_token_out_of_range(target, good_drafter, tmp_path, mask):
    d = edit_config(copy_checkpoint(good_drafter, tmp_path / "d"), dflash_config={"mask_token_id": mask})
    with pytest.raises(ValueError, match=rf"mask_token_id {mask} outside the target's {VOCAB}"):
        build(target, d)


def test_trained_for_other_target_depth(target, good_drafter, tmp_path):
    d = edit_config(copy_checkpoint(good_drafter, tmp_path / "d"), num_target_layers=LAYERS + 2)
    with pytest.raises(ValueError, match=rf"trained for {LAYERS + 2} target layers, target has {LAYERS}"):
        build(target, d)


def test_all_mismatches_named_at_once(target, tmp_path):
    d = make_drafter(tmp_path / "d", target, hidden=40, vocab=VOCAB + 1, target_layer_ids=[0, 9])
    with pytest.raises(ValueError) as e:
        build(target, d)
    msg = str(e.value)
    for part in ("hidden size", "vocab size", "mask_token_id", "target_layer_ids"):
        assert part in msg, msg


# -- things that are not (complete) drafters ------------------------------------------------------

def test_target_checkpoint_as_drafter(target):
    with pytest.raises(ValueError, match=r"not a DFlash drafter.*LlamaForCausalLM"):
        build(target, target)


def test_directory_without_config(target, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        build(target, tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="config.json"):
        build(target, tmp_path / "does-not-exist")


def test_config_without_dflash_fields(target, good_drafter, tmp_path):
    d = copy_checkpoint(good_drafter, tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id"):
        build(target, d)


def with_config_entry(drafter, dst, key: str, value):
    """A copy of the drafter whose config.json has `key` set to `value`."""
    d = copy_checkpoint(drafter, dst)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_drafter_config_with_a_block_under_two_is_refused(target, good_drafter, tmp_path):
    """The drafter's own config is checked, not only an engine override: a block is the anchor
    and at least one drafted position."""
    d = with_config_entry(good_drafter, tmp_path / "d", "block_size", 1)
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        DFlashConfig.from_dir(d)
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        build(target, d, spec="dflash")


@pytest.mark.parametrize("value,ok", [(5, True), (0, False), ("8", False)])
def test_default_budget_from_drafter_config(target, good_drafter, tmp_path, value, ok):
    """A drafter may name its measured-best DDTree budget; --budget still wins; a bad one is refused."""
    d = with_config_entry(good_drafter, tmp_path / "d", "ddtree_default_budget", value)
    if not ok:
        with pytest.raises(ValueError, match="ddtree_default_budget must be a positive integer"):
            build(target, d, spec="ddtree")
        return
    assert build(target, d, spec="ddtree").engine.spec.budget == value
    assert build(target, d, spec="ddtree", budget=3).engine.spec.budget == 3
    assert build(target, good_drafter, spec="ddtree").engine.spec.budget == 32


@pytest.mark.parametrize("value,ok", [("16:0", True), ("4:8,16:0", True), ("16", False), (16, False)])
def test_default_schedule_from_drafter_config(target, good_drafter, tmp_path, value, ok, caplog):
    """A drafter config's budget schedule is validated but not applied: an explicit --budget drafts
    every round unless --budget-schedule limits it, and auto chooses per round (a warning says so);
    a bad one is refused."""
    d = with_config_entry(good_drafter, tmp_path / "d", "ddtree_default_budget_schedule", value)
    if not ok:
        with pytest.raises(ValueError, match="ddtree_default_budget_schedule must be"):
            build(target, d, spec="ddtree")
        return
    with caplog.at_level("WARNING"):
        assert build(target, d, spec="ddtree", budget=32).engine.spec.budget_schedule == ()
    assert any("ddtree_default_budget_schedule not applied" in r.message for r in caplog.records)
    assert build(target, d, spec="ddtree", budget=32, budget_schedule="8:2").engine.spec.budget_schedule == ((8, 2),)
    assert build(target, d, spec="ddtree", budget=32, budget_schedule="none").engine.spec.budget_schedule == ()
    # auto chooses per round: an explicit schedule caps it
    assert build(target, d, spec="ddtree").engine.spec.budget_schedule == ()
    assert build(target, d, spec="ddtree", budget_schedule="8:2").engine.spec.budget_schedule == ((8, 2),)
    assert build(target, d, spec="dflash").engine.spec.budget_schedule == ()
    assert build(target, d, spec="dflash", budget_schedule="16:0").engine.spec.budget_schedule == ((16, 0),)


def test_drafter_without_weights(target, good_drafter, tmp_path):
    d = copy_checkpoint(good_drafter, tmp_path / "d")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        build(target, d)


@pytest.mark.parametrize("name", ["fc.weight", "hidden_norm.weight", "layers.1.mlp.down_proj.weight",
                                  "layers.0.self_attn.k_proj.weight"])
def test_missing_tensor(target, good_drafter, tmp_path, name):
    d = edit_tensors(copy_checkpoint(good_drafter, tmp_path / "d"), lambda w: {k: v for k, v in w.items() if k != name})
    with pytest.raises(ValueError, match=rf"missing tensor '{name}'"):
        build(target, d)


def test_missing_qk_norm(target, good_drafter, tmp_path):
    d = edit_tensors(copy_checkpoint(good_drafter, tmp_path / "d"),
                     lambda w: {k: v for k, v in w.items() if k != "layers.1.self_attn.q_norm.weight"})
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.self_attn\.q_norm\.weight"):
        build(target, d)


def test_tensor_of_wrong_shape(target, good_drafter, tmp_path):
    # three target layers named, but fc still projects two layers' features
    d = edit_config(copy_checkpoint(good_drafter, tmp_path / "d"), dflash_config={"target_layer_ids": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(48, 96\), the config implies \(48, 144\)"):
        build(target, d)


# -- spec settings ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["ddtree", "dflash"])
def test_speculation_without_drafter(target, spec):
    with pytest.raises(ValueError, match=rf"spec='{spec}' needs a draft model"):
        build(target, None, spec=spec)


def test_unknown_method_and_bad_block_size(target, good_drafter):
    with pytest.raises(ValueError, match="unknown spec method 'eagle'"):
        build(target, good_drafter, spec="eagle")
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        build(target, good_drafter, spec="dflash", block_size=1)
    with pytest.raises(ValueError, match="budget must be >= 1|budget >= 1"):
        build(target, good_drafter, spec="ddtree", budget=-3)


@pytest.mark.parametrize("field", ["budget", "block_size"])
def test_zero_budget_or_block_size_is_refused(target, good_drafter, field):
    """An explicit 0 is as invalid as -3 (budget) or 1 (block_size): it must be refused, not
    silently replaced by the default (32, or the drafter's block size)."""
    with pytest.raises(ValueError, match=field):
        build(target, good_drafter, spec="ddtree", **{field: 0})


# -- the published format round-trips -----------------------------------------------------------

def test_config_fields_are_used(target, tmp_path):
    d = make_drafter(tmp_path / "d", target, block_size=5, target_layer_ids=[1])
    edit_config(d, dflash_config={"mask_token_id": 2})
    llm = build(target, d, spec=None)
    eng = llm.engine
    assert eng.spec.method == "ddtree" and eng.spec.budget == 32      # the defaults with a drafter
    assert eng.spec.block_size == 5                                   # the drafter's block size
    assert eng.runner.drafter.cfg.mask_token_id == 2
    assert eng.runner.drafter.cfg.target_layer_ids == (1,)
    assert eng.runner.drafter.cfg.num_target_layers == LAYERS
    assert eng.runner.capture_layers == (1,)
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert max(out.metrics["accept_lengths"]) <= 5 and len(out.token_ids) == 30
    # a block size given explicitly wins over the drafter's
    assert build(target, d, spec="dflash", block_size=3).engine.spec.block_size == 3
    # and the plain engine needs no drafter at all
    assert build(target, d, spec="none").engine.runner.drafter is None


def reference_draft_logits(hf, drafter_dir, committed: list[int], bonus: int, block_size: int) -> torch.Tensor:
    """The DFlash drafter written out from its published config and tensors: context features
    are the target's hidden states after each of target_layer_ids (Hugging Face's
    hidden_states[i + 1]) for all committed tokens, projected by fc + hidden_norm; the block is
    [bonus, mask * (block_size - 1)] at the next positions, attending without a causal mask to
    [context ; block]. Returns the logits of block positions 1.. [block_size - 1, V]."""
    from safetensors.torch import load_file

    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = load_file(str(drafter_dir / "model.safetensors"))
    ids, mask = cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["mask_token_id"]
    H, Hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    with torch.no_grad():
        hs = hf(torch.tensor([committed]), output_hidden_states=True).hidden_states
        ctx = ref_rms(torch.cat([hs[i + 1][0] for i in ids], -1) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        P = len(committed)
        x = hf.get_input_embeddings()(torch.tensor([bonus] + [mask] * (block_size - 1)))
        qpos, kpos = torch.arange(P, P + block_size), torch.arange(P + block_size)
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            h = ref_rms(x, w[p + "input_layernorm.weight"], eps)
            kv_in = torch.cat([ctx, h])
            q = ref_rms((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, H, hd), w[p + "self_attn.q_norm.weight"], eps)
            k = ref_rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, Hkv, hd),
                     w[p + "self_attn.k_norm.weight"], eps)
            v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, Hkv, hd)
            q, k = ref_rope(q, qpos, theta), ref_rope(k, kpos, theta)
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
            att = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", att, v).reshape(block_size, H * hd)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = ref_rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        return hf.lm_head(ref_rms(x, w["norm.weight"], eps))[1:].float()


@pytest.mark.parametrize("ids,mask,block_size,budget", [([0, 1], 2, None, None), ([1], VOCAB - 1, 7, None),
                                                       ([0, 1], 5, 4, 40), ([0, 1], 5, 7, 3)])
def test_draft_matches_reference_implementation(target, tmp_path, monkeypatch, ids, mask, block_size, budget):
    """The engine's drafts in every round of a generation (the first right after the prefill)
    equal the reference drafter's on the same committed tokens: fc, hidden_norm, the layer
    features, the mask token, positions and the block size are all taken from the checkpoint
    as published. With a DDTree budget above the vocabulary every round accepts at least two
    tokens, so the context carried from one round's accepted path into the next is checked.
    With a budget below block_size - 1 the drafter's LM head runs on `budget` positions only."""
    from transformers import AutoModelForCausalLM

    from drafttree.spec_decode import rounds

    d = make_drafter(tmp_path / "d", target, block_size=5, target_layer_ids=ids)
    edit_config(d, dflash_config={"mask_token_id": mask})
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    llm = build(target, d, spec="ddtree" if budget else "dflash", block_size=block_size, budget=budget or 1)
    bs = block_size or 5
    assert llm.engine.spec.block_size == bs

    calls = []
    original = rounds.draft

    def recording_draft(rc, B, kv_len):
        logits = original(rc, B, kv_len)
        calls.append((int(rc.state.start[0]), int(rc.state.bonus[0]), logits[0].clone()))
        return logits

    monkeypatch.setattr(rounds, "draft", recording_draft)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    seq = prompt + out.token_ids
    assert len(calls) == out.metrics["rounds"] >= 3
    assert calls[0][0] == len(prompt)
    if budget and budget >= VOCAB:
        assert min(out.metrics["accept_lengths"]) >= 2
    for start, bonus, got in calls:
        depth = min(bs - 1, budget) if budget else bs - 1   # a tree of n nodes is at most n deep
        assert got.shape == (depth, VOCAB)
        assert bonus == seq[start]
        want = reference_draft_logits(hf, d, seq[:start], bonus, bs)[:depth]
        err = (got - want).abs().max() / want.abs().max()
        assert err < 1e-4, f"draft at position {start}: relative error {err:.2e}"


def test_last_layer_feature_matches_reference(target, tmp_path, monkeypatch):
    """target_layer_ids may name the target's last layer (upstream's layer choice never does,
    but the format allows it). The DFlash reference reads hidden_states[layer_id + 1], which
    for the last layer is Hugging Face's output after the final norm."""
    test_draft_matches_reference_implementation(target, tmp_path, monkeypatch, [0, LAYERS - 1], 2, None, None)
