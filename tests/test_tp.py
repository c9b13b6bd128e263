"""Tensor parallelism is lossless: at tensor_parallel_size 2 (gloo processes on the CPU, fp32) plain
decoding, DFlash and DDTree give TP=1's tokens, greedy and sampled with a seed, and every rank
holds the same round state afterwards (the ranks decide alike without exchanging decisions).

The Llama has one KV head (each rank holds a copy) and tied embeddings; the Qwen3 two KV heads
(one per rank), q/k norms and an untied head. A tiny vocabulary (7) does not divide by 2: the
vocabulary-parallel embedding and head pad their last shard.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.models.decoder import DecoderLayer, DecoderLM
from drafttree.models.random_shapes import SHAPES, projections
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import head_rows
from tests.helpers import Pair, make_prompts

MAX_TOKENS = [32, 11, 23]   # rows finish at different rounds: the others move down (a command too)


def mixed() -> list[SamplingParams]:
    """A greedy row, a sampled row and a filtered sampled row, each seeded."""
    return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[0], ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS[1], ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=4, seed=11, max_tokens=MAX_TOKENS[2], ignore_eos=True)]


@contextlib.contextmanager
def sharded(pair: Pair, spec: str, world: int = 2) -> Iterator[LLM]:
    """The engine `pair.llm(spec)` is, over `world` ranks."""
    budget = 32 if spec == "ddtree" else 1 if spec == "dflash" else None
    llm = LLM(model=str(pair.target), draft_model=None if spec == "none" else str(pair.drafter), spec=spec,
              budget=budget, device="cpu", dtype="float32", max_num_seqs=3, max_model_len=128,
              tensor_parallel_size=world)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.mark.parametrize("shape", ["llama-mqa", "qwen3"])
@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_tp2_gives_tp1_tokens(zoo, shape, spec):
    pair = zoo(shape)
    prompts = make_prompts(pair.vocab)
    want = pair.llm(spec).generate(prompts, mixed())
    with sharded(pair, spec) as llm:
        assert llm.engine.world == 2
        assert llm.engine.runner.kv.k.shape[2] == {"llama-mqa": 1, "qwen3": 1}[shape]   # 1 of 1, 1 of 2
        got = llm.generate(prompts, mixed())
        again = llm.generate(prompts[:1], mixed()[:1])   # its pages from the prefix cache this time
        assert llm.engine.agree()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.metrics["accept_lengths"] == w.metrics["accept_lengths"]   # the same drafts, accepted alike
    assert again[0].token_ids == want[0].token_ids
    if spec != "none":
        assert max(t for o in got for t in o.metrics["accept_lengths"]) > 1   # speculation really accepted


@pytest.mark.slow
def test_default_model_at_tp3_gives_tp1_tokens():
    """SmolLM2-135M has 9 heads and 3 KV heads: it takes sizes 1 and 3 (2 is refused)."""
    from drafttree.loader.default_model import default_gguf_path
    try:
        default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    kw = dict(spec="ddtree", budget=8, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    chat = [{"role": "user", "content": "Write quicksort in Python."}]
    want = LLM(**kw).chat(chat, params)[0]
    three = LLM(tensor_parallel_size=3, **kw)
    try:
        got = three.chat(chat, params)[0]
        assert three.engine.agree()
    finally:
        three.shutdown()
    assert got.token_ids == want.token_ids and got.metrics["accept_lengths"] == want.metrics["accept_lengths"]


# -- shapes (no processes) ------------------------------------------------------------------------

def fake_group(rank: int, world: int) -> TPGroup:
    """A group of `world` ranks for building shard shapes on the meta device (no collective runs)."""
    return TPGroup(rank, world, torch.device("cpu"), None, None, 60.0)


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen3-32b"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_rank_projections_are_the_sharded_layers(shape, world):
    """The kernel benchmarks and block tables see each rank's weights: those its layers hold."""
    from drafttree.kernels import gemm_kernel, gemv_kernel

    cfg = SHAPES[shape][0]
    with torch.device("meta"):
        layer = DecoderLayer(cfg, fake_group(world - 1, world))
    have = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    assert projections(cfg, world) == {name: tuple(m.weight.shape) for name, m in have.items()}
    kinds = {"qkv": "norm", "o": "plain", "gate_up": "glu", "down": "plain"}
    for name, (N, K) in projections(cfg, world).items():
        w = torch.empty(N, K, device="meta", dtype=torch.bfloat16)
        assert gemv_kernel.check(kinds[name], torch.empty(1, 1, K, device="meta", dtype=torch.bfloat16), w) == 1
        assert gemv_kernel.blocks_for(kinds[name], N * K) is not None
        gemm_kernel.blocks_for(kinds[name], N * K)   # a class (tiles or the torch ops) for every size


def test_vocabulary_shards_and_kv_heads():
    cfg = SHAPES["qwen3-8b"][0]   # 32 heads, 8 KV heads, 151,936 rows
    with torch.device("meta"):
        model = DecoderLM(cfg, fake_group(1, 4))
    assert model.embed_tokens.weight.shape == (151936 // 4, 4096) and model.kv_layout.kv_heads == 2
    assert head_rows(cfg, 1, 4) == (slice(8 * 128, 16 * 128), slice(2 * 128, 4 * 128))
    # 8 KV heads over 16 ranks: ranks 2k and 2k + 1 share KV head k, and hold query heads 2r, 2r + 1
    assert head_rows(cfg, 5, 16) == (slice(10 * 128, 12 * 128), slice(2 * 128, 3 * 128))
