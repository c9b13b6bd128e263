"""DFlash2 drafters (docs/dflash2.md): the published format loads, bad configs are refused by
name, the forward and the selector equal a reference written from the format, the chain and the
tree are built as the selector defines them, and every speculative path gives plain decoding's
tokens (T = 0 and seeded sampling, fp32 on CPU)."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from drafttree import LLM, SamplingParams
from drafttree.spec_decode import rounds
from drafttree.spec_decode.selector import build_selector_tree, selector_chain
from tests.helpers import check_lossless, gpu, make_prompts, ref_rms, ref_rope, taus_of
from tests.tiny import copy_checkpoint, edit_config, edit_tensors, make_drafter, make_target

VOCAB = 5    # small: the random drafters' chains and trees get accepted deep enough to matter
LAYERS = 3


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """shape -> (target, DFlash2 drafter of block size 4)."""
    out = {}
    for shape in ("llama", "qwen3"):
        root = tmp_path_factory.mktemp(f"dflash2-{shape}")
        t = make_target(root / "t", shape, vocab=VOCAB, layers=LAYERS, scale=3.0)
        out[shape] = t, make_drafter(root / "d", t, block_size=4, arch="dflash2")
    return out


def engine(target, drafter, spec="none", budget=None, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "max_num_seqs": 3, "max_model_len": 128, **kw}
    if spec != "none":
        kw.update(draft_model=str(drafter), budget=budget if budget is not None else (1 if spec == "dflash" else 32))
    return LLM(model=str(target), spec=spec, **kw)


# -- the format ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rename", ["as published", "model. prefix", "codebooks with .weight"])
def test_published_layout_loads(pairs, tmp_path, rename):
    t, d = pairs["llama"]
    if rename != "as published":
        def edit(w):
            if rename == "model. prefix":
                return {"model." + k: v for k, v in w.items()}
            return {k + ".weight" if k.endswith("_codebook") else k: v for k, v in w.items()}
        d = edit_tensors(copy_checkpoint(d, tmp_path / "d"), edit)
    drafter = engine(t, d, "dflash").engine.runner.drafter
    from safetensors.torch import load_file
    w = load_file(str(pairs["llama"][1] / "model.safetensors"))
    assert type(drafter).__name__ == "DFlash2Drafter"
    c = drafter.cfg
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 4, 8, 4)
    assert torch.equal(drafter.layers[1].mlp_conv.base_kernel, w["layers.1.mlp_conv.base_kernel"])
    assert torch.equal(drafter.layers[0].attention_conv.kernel_projection.weight,
                       w["layers.0.attention_conv.kernel_projection.weight"])
    assert torch.equal(drafter.candidate_selector.predecessor_codebook, w["candidate_selector.predecessor_codebook"])
    assert torch.equal(drafter.candidate_selector.hidden_projection.weight,
                       w["candidate_selector.hidden_projection.weight"])


@pytest.mark.parametrize("edit,match", [
    ({"dflash_config": {"use_swa": True}}, r"dflash_config\.use_swa is not a DFlash2 field"),
    ({"dflash_config": {"selector_rank": 0}}, r"dflash_config\.selector_rank must be a positive integer"),
    ({"dflash_config": {"selector_top_k": 2.5}}, r"dflash_config\.selector_top_k must be a positive integer"),
    ({"dflash_config": {"conv_group_size": 5}}, r"dflash_config\.conv_group_size 5 must divide hidden_size 48"),
    ({"dflash_config": {"selector_top_k": VOCAB + 1}}, r"dflash_config\.selector_top_k 6 exceeds vocab_size 5"),
    ({"dflash_config": {"output_multiplier": "2"}}, r"dflash_config\.output_multiplier must be a finite number"),
    ({"dflash_config": {"final_logit_softcapping": -1}}, r"dflash_config\.final_logit_softcapping must be"),
    ({"dflash_config": {"causal": "no"}}, r"is_causal / dflash_config\.causal must be true or false"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, r"layer_types mixes full"),
    ({"layer_types": ["sliding_attention"] * 2}, r"sliding_attention layers need sliding_window"),
    ({"layer_types": ["full_attention"]}, r"layer_types must list one of"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
])
def test_bad_config_is_refused_by_name(pairs, tmp_path, edit, match):
    t, d = pairs["llama"]
    d = edit_config(copy_checkpoint(d, tmp_path / "d"), **edit)
    with pytest.raises(ValueError, match=match):
        engine(t, d, "ddtree")


def test_missing_dflash2_field_and_tensor(pairs, tmp_path):
    t, d = pairs["llama"]
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dflash_config"]["conv_kernel_size"]
    bad = copy_checkpoint(d, tmp_path / "a")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"needs dflash_config\.conv_kernel_size"):
        engine(t, bad, "dflash")
    name = "layers.1.mlp_conv.base_kernel"
    bad = edit_tensors(copy_checkpoint(d, tmp_path / "b"), lambda w: {k: v for k, v in w.items() if k != name})
    with pytest.raises(ValueError, match=rf"missing tensor '{name}'"):
        engine(t, bad, "dflash")
    bad = edit_tensors(copy_checkpoint(d, tmp_path / "c"),
                       lambda w: {**w, "candidate_selector.successor_codebook": torch.zeros(VOCAB, 3)})
    with pytest.raises(ValueError, match=r"'candidate_selector\.successor_codebook' has shape \(5, 3\), "
                                         r"the config implies \(5, 8\)"):
        engine(t, bad, "dflash")


# -- the reference ------------------------------------------------------------------------------

def _conv(x, dyn, base, group):
    """The block convolution position by position: out[i] = sum_t (base[t] + dyn[i, t, group]) x[i - t]."""
    W, D = x.shape
    out = torch.zeros_like(x)
    for i in range(W):
        for t in range(base.shape[0]):
            if i - t >= 0:
                out[i] += (base[t] + dyn[i, t].repeat_interleave(group)) * x[i - t]
    return out


def reference_dflash2(hf, drafter_dir, committed: list[int], bonus: int, bs: int, depth: int):
    """The DFlash2 drafter written out from its config and tensors (docs/dflash2.md): returns the
    final-normed block hidden states [bs, D], the candidates [depth, K], the edge scores with the
    published unary logits [depth, K, K] and the greedy walk's tokens [depth]."""
    from safetensors.torch import load_file

    cfg = json.loads((drafter_dir / "config.json").read_text())
    dc = cfg["dflash_config"]
    w = load_file(str(drafter_dir / "model.safetensors"))
    H, Hkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    taps, group, K = dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_top_k"]
    window = cfg.get("sliding_window") if (cfg.get("layer_types") or ["full"])[0] == "sliding_attention" else None
    causal = cfg.get("is_causal", False)
    with torch.no_grad():
        hs = hf(torch.tensor([committed]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in dc["target_layer_ids"]], -1)
        ctx = ref_rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        P = len(committed)
        x = hf.get_input_embeddings()(torch.tensor([bonus] + [dc["mask_token_id"]] * (bs - 1)))
        x = x * dc.get("input_embedding_scale", 1.0)
        qpos, kpos = torch.arange(P, P + bs), torch.arange(P + bs)
        rel = qpos[:, None] - kpos[None, :]
        seen = torch.ones(bs, P + bs, dtype=torch.bool)
        if causal:
            seen &= rel >= 0
        if window:
            seen &= rel.abs() < window

        def wrapped(x, p, conv, sub):
            dyn = (x @ w[f"{p}{conv}.kernel_projection.weight"].T).view(bs, 2, taps, -1)
            base = w[f"{p}{conv}.base_kernel"]
            return _conv(sub(_conv(x, dyn[:, 0], base[0], group)), dyn[:, 1], base[1], group)

        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."

            def attention(h):
                kv_in = torch.cat([ctx, h])
                q = ref_rms((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, H, hd), w[p + "self_attn.q_norm.weight"],
                         eps)
                k = ref_rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, Hkv, hd),
                         w[p + "self_attn.k_norm.weight"], eps)
                v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, Hkv, hd)
                q, k = ref_rope(q, qpos, cfg["rope_theta"]), ref_rope(k, kpos, cfg["rope_theta"])
                k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
                s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
                att = s.masked_fill(~seen, float("-inf")).softmax(-1)
                return torch.einsum("hqk,khd->qhd", att, v).reshape(bs, H * hd) @ w[p + "self_attn.o_proj.weight"].T

            def mlp(h):
                return (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                    @ w[p + "mlp.down_proj.weight"].T

            x = x + wrapped(ref_rms(x, w[p + "input_layernorm.weight"], eps), p, "attention_conv", attention)
            x = x + wrapped(ref_rms(x, w[p + "post_attention_layernorm.weight"], eps), p, "mlp_conv", mlp)
        hidden = ref_rms(x, w["norm.weight"], eps)
        unary = hf.lm_head(hidden[1:1 + depth]).float() * dc.get("output_multiplier", 1.0)
        cap = dc.get("final_logit_softcapping")
        if cap:
            unary = torch.tanh(unary / cap) * cap
        u, cand = unary.topk(K, dim=-1)
        hp = hidden[1:1 + depth] @ w["candidate_selector.hidden_projection.weight"].T
        Pc, Qc = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
        scores = torch.zeros(depth, K, K)
        for d in range(depth):
            for a in range(K):
                prev = bonus if d == 0 else int(cand[d - 1, a])
                for c in range(K):
                    scores[d, a, c] = u[d, c] + (Pc[prev] * hp[d] * Qc[cand[d, c]]).sum()
        walk, at = [], 0
        for d in range(depth):
            at = int(scores[d, at].argmax())
            walk.append(int(cand[d, at]))
        return hidden, cand, scores, walk


VARIANTS = {
    "as published": {},
    "window, causal, scales": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 6, "is_causal": True,
                               "dflash_config": {"input_embedding_scale": 1.5, "output_multiplier": 0.7,
                                                 "final_logit_softcapping": 3.0}},
    "window, non-causal": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 5, "is_causal": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec,budget", [("dflash", 1), ("ddtree", 3)])
def test_forward_and_selector_match_reference(pairs, tmp_path, monkeypatch, variant, spec, budget):
    """In every round of a generation the drafter's block hidden states, candidates and edge
    scores (up to the constant per position the log-probabilities subtract) equal the
    reference's on the same committed tokens, past the window's reach; the chain is the
    reference's greedy walk, which differs from the per-position argmax somewhere."""
    from transformers import AutoModelForCausalLM

    t, d = pairs["llama"]
    d = edit_config(copy_checkpoint(d, tmp_path / "d"), **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    llm = engine(t, d, spec, budget)
    rc = llm.engine.runner.round_ctx
    depth = rc.spec.depth_at(1)
    calls = []
    original = rounds.selector_tree

    def recording(rc_, hidden, B):
        tree = original(rc_, hidden, B)
        cand, scores = rc_.drafter.edge_scores(hidden, rc_.state.bonus[:B], depth)
        calls.append((int(rc_.state.start[0]), int(rc_.state.bonus[0]), hidden[0].clone(), cand[0].clone(),
                      scores[0].clone(), tree.tokens[0].clone()))
        return tree

    monkeypatch.setattr(rounds, "selector_tree", recording)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    seq = prompt + out.token_ids
    assert len(calls) == out.metrics["rounds"] >= 3
    walks_off_argmax = 0
    for start, bonus, hidden, cand, scores, tokens in calls:
        assert bonus == seq[start]
        h, c, s, walk = reference_dflash2(hf, d, seq[:start], bonus, 4, depth)
        assert (hidden - h).abs().max() < 1e-4 * h.abs().max(), f"hidden states at position {start}"
        assert torch.equal(cand, c)
        assert (s.log_softmax(-1) - scores.log_softmax(-1)).abs().max() < 1e-3
        if spec == "dflash":
            assert tokens[1:].tolist() == walk
        walks_off_argmax += walk != c[:, 0].tolist()
    assert walks_off_argmax > 0, "the selector never changed the chain: the test would not see it ignored"


# -- the chain and the tree ------------------------------------------------------------------------

def _random_edges(R=2, D=3, K=3, V=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(D)]) for _ in range(R)])
    scores = torch.randn(R, D, K, K, generator=g) * 2
    return cand, scores


@pytest.mark.parametrize("budget", [1, 2, 5, 13, 39, 50])
def test_selector_tree_is_the_best_prefix_set(budget):
    """Against every prefix enumerated: the tree holds the `budget` most probable prefixes of the
    selector's chain (position 1 from the anchor's row, each later one from its predecessor's),
    best first, parents before children, with their path log-probabilities."""
    cand, scores = _random_edges()
    R, D, K = cand.shape
    tree, node_lp = build_selector_tree(cand, scores, torch.tensor([7, 8]), budget)
    lp = scores.log_softmax(-1)
    assert tree.tokens.shape == (R, budget + 1) and node_lp.shape == (R, budget)
    for r in range(R):
        every = {}
        for n in range(1, D + 1):
            for path in itertools.product(range(K), repeat=n):
                prev, total = 0, 0.0
                for d, c in enumerate(path):
                    total += float(lp[r, d, prev, c])
                    prev = c
                every[tuple(int(cand[r, d, c]) for d, c in enumerate(path))] = total
        best = sorted(every.items(), key=lambda kv: -kv[1])[:budget]
        got = {}
        for i in range(1, budget + 1):
            if not tree.valid[r, i]:
                continue
            p = int(tree.parents[r, i])
            assert p < i and tree.depth[r, i] == tree.depth[r, p] + 1
            path, j = [], i
            while j:
                path.append(int(tree.tokens[r, j]))
                j = int(tree.parents[r, j])
            got[tuple(reversed(path))] = float(node_lp[r, i - 1])
        assert set(got) == {k for k, _ in best}
        for k, v in best:
            assert abs(got[k] - v) < 1e-5
        valid_lp = node_lp[r][tree.valid[r, 1:]]
        assert (valid_lp[1:] <= valid_lp[:-1] + 1e-6).all(), "not best first"


def test_selector_chain_is_the_greedy_walk():
    cand, scores = _random_edges(seed=3)
    tree, path_lp = selector_chain(cand, scores, torch.tensor([1, 2]))
    lp = scores.log_softmax(-1)
    for r in range(cand.shape[0]):
        at, total = 0, 0.0
        for d in range(cand.shape[1]):
            nxt = int(scores[r, d, at].argmax())
            total += float(lp[r, d, at, nxt])
            at = nxt
            assert tree.tokens[r, d + 1] == cand[r, d, at]
            assert abs(float(path_lp[r, d]) - total) < 1e-5
    assert tree.tokens[:, 0].tolist() == [1, 2]


# -- lossless decoding ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["llama", "qwen3"])
@pytest.mark.parametrize("spec,budget,block_size", [("dflash", 1, None), ("ddtree", 12, None), ("ddtree", 3, 6)])
def test_greedy_equals_plain(pairs, shape, spec, budget, block_size):
    """T = 0: the selector's chain and tree give plain decoding's tokens; three prompts batched, a
    block size other than the checkpoint's (the convolution follows the draft's width)."""
    from tests.helpers import Pair

    t, d = pairs[shape]
    pair = Pair(t, d, VOCAB)
    llm = engine(t, d, spec, budget, block_size=block_size)
    bs = block_size or 4
    outs = check_lossless(pair, llm, make_prompts(VOCAB), max_tau=bs if spec == "dflash" else min(budget, bs - 1) + 1)
    assert max(taus_of(outs)) >= 3, "no round accepted two drafted tokens"


@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_seeded_sampling_equals_plain(pairs, shape):
    """T > 0, seeded: the same tokens as plain decoding with the same seeds, with and without top-p."""
    t, d = pairs[shape]
    prompts = make_prompts(VOCAB, lens=(3, 11), seed=4)
    sp = [SamplingParams(temperature=0.9, max_tokens=30, seed=5, ignore_eos=True),
          SamplingParams(temperature=1.2, top_p=0.8, max_tokens=30, seed=6, ignore_eos=True)]
    want = [o.token_ids for o in engine(t, d).generate(prompts, sp)]
    taus = []
    for spec, budget in (("dflash", 1), ("ddtree", 12)):
        outs = engine(t, d, spec, budget).generate(prompts, sp)
        assert [o.token_ids for o in outs] == want, spec
        taus += taus_of(outs)
    assert max(taus) >= 3


@pytest.mark.parametrize("spec,budget", [("dflash", 1), ("ddtree", 12)])
def test_graph_runner_replays_dflash2_rounds(pairs, fake_cuda_graphs, spec, budget):
    """The graph runner's logic (keys, buckets, parked rows) with a DFlash2 drafter: every round
    replays a captured step, to plain decoding's tokens, greedy and seeded."""
    t, d = pairs["qwen3"]
    prompts = make_prompts(VOCAB, lens=(3, 11), seed=2)
    sp = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.9, max_tokens=20, seed=3, ignore_eos=True)]
    want = [o.token_ids for o in engine(t, d).generate(prompts, sp)]
    llm = engine(t, d, spec, budget, cuda_graphs=True, prefill_graphs=False)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert llm.engine.runner.graphs.fallbacks == 0 and len(fake_cuda_graphs) > 0


def test_memory_plan_counts_the_drafter(pairs):
    """The memory plan's drafter bytes are its parameters' (the convolutions and the selector too)."""
    from drafttree.config import ModelConfig
    from drafttree.engine.memory_plan import rank_weights
    from drafttree.models.dflash2 import DFlash2Drafter, drafter_config

    t, d = pairs["qwen3"]
    cfg = drafter_config(d)
    with torch.device("meta"):
        n = sum(p.numel() for p in DFlash2Drafter(cfg).parameters())
    assert rank_weights(ModelConfig.from_dir(t), None, torch.float32, drafter=cfg)["drafter"] == 4 * n


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory):
    """A target and a DFlash2 drafter whose heads the attention kernels take (head dim 16), block 8,
    8 candidates, a window of 24 that the prompts and answers outgrow."""
    root = tmp_path_factory.mktemp("dflash2-gpu")
    t = make_target(root / "t", "qwen3", vocab=61, layers=3, scale=3.0)
    d = make_drafter(root / "d", t, block_size=8, target_layer_ids=[0, 2], head_dim=16, arch="dflash2")
    edit_config(d, layer_types=["sliding_attention"] * 2, sliding_window=24, is_causal=False,
                dflash_config={"selector_top_k": 8})
    return t, d


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,quant", [("float32", None), gpu("bfloat16", None), gpu("bfloat16", "fp8")])
@pytest.mark.parametrize("spec,budget", [("dflash", 1), ("ddtree", 12), ("ddtree", 3)])
def test_gpu_graphs_equal_eager_and_plain(gpu_pair, spec, budget, dtype, quant):
    """On CUDA: the draft step with its selector is captured per batch bucket like DFlash's, and
    graphed rounds (batch 3 in the bucket of 4) give eager's tokens, and in fp32 plain decoding's,
    at T = 0 and seeded T > 0; with the drafter's weights in fp8 too."""
    t, d = gpu_pair
    prompts = make_prompts(61, lens=(1, 7, 30), seed=2)
    sp = [SamplingParams(temperature=T, max_tokens=40, seed=i, ignore_eos=True) for i, T in enumerate((0.0, 0.8, 0.0))]
    kw = dict(device="cuda", dtype=dtype, max_num_seqs=4)
    eager = [o.token_ids for o in engine(t, d, spec, budget, cuda_graphs=False, draft_quantization=quant,
                                         **kw).generate(prompts, sp)]
    llm = engine(t, d, spec, budget, cuda_graphs=True, draft_quantization=quant, **kw)
    assert type(llm.engine.runner.drafter).__name__ == "DFlash2Drafter"
    assert [o.token_ids for o in llm.generate(prompts, sp)] == eager
    assert llm.engine.runner.graphs.fallbacks == 0
    if dtype == "float32":
        assert eager == [o.token_ids for o in engine(t, d, cuda_graphs=False, **kw).generate(prompts, sp)]
