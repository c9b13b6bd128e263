"""Our target models against Hugging Face transformers (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.loader.weights import load_target
from drafttree.models.kv_cache import KVCache, attn_meta, causal
from tests.tiny import SHAPES, make_target

SHAPE_NAMES = sorted(SHAPES)


@pytest.fixture(scope="module", params=SHAPE_NAMES)
def tiny(request, tmp_path_factory):
    return request.param, make_target(tmp_path_factory.mktemp(request.param), request.param)


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_logits_match_transformers(tiny):
    name, path = tiny
    model, cfg = load_target(path, torch.float32, "cpu")
    ref = hf_model(path)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        want = ref(ids).logits
        kv = KVCache.allocate(cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        start = torch.zeros(2, dtype=torch.long)
        pos = torch.arange(37)[None].expand(2, 37)
        hidden, _ = model(ids, pos, attn_meta(start, causal(2, 37, "cpu"), 37), kv.k, kv.v)
        got = model.logits(hidden)
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-4, f"{name}: relative error {rel:.2e}"


def test_incremental_decode_matches_full_forward(tiny):
    """Prefill part of a sequence, then feed the rest in chunks through the cache."""
    _, path = tiny
    model, cfg = load_target(path, torch.float32, "cpu")
    ref = hf_model(path)
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits[0]
        kv = KVCache.allocate(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        got = []
        for a, b in [(0, 7), (7, 8), (8, 13), (13, 20)]:
            W = b - a
            start = torch.tensor([a])
            h, _ = model(ids[:, a:b], torch.arange(a, b)[None], attn_meta(start, causal(1, W, "cpu"), 64),
                         kv.k, kv.v)
            got.append(model.logits(h)[0])
    got = torch.cat(got)
    assert ((got - want).norm() / want.norm()) < 1e-4


@pytest.mark.parametrize("prompt_len", [1, 5, 23])
def test_greedy_generation_matches_transformers(tiny, prompt_len):
    name, path = tiny
    ref = hf_model(path)
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=128)
    g = torch.Generator().manual_seed(prompt_len)
    prompts = [torch.randint(0, 97, (prompt_len,), generator=g).tolist() for _ in range(2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            x = torch.tensor([p])
            want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                                min_new_tokens=24, pad_token_id=-1)[0, len(p):].tolist()
        assert out.token_ids == want, f"{name} prompt_len={prompt_len}"
        assert out.finish_reason == "length"
