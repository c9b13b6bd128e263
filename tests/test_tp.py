"""Tensor parallelism is lossless: at tensor_parallel_size 2 (gloo processes on the CPU, fp32) plain
decoding, DFlash and DDTree give TP=1's tokens, greedy and sampled with a seed, and every rank
holds the same round state afterwards (the ranks decide alike without exchanging decisions).

The Llama has one KV head (each rank holds a copy) and tied embeddings; the Qwen3 two KV heads
(one per rank), q/k norms and an untied head; the GQA Llama three KV heads of nine query heads,
split unevenly by whole groups (2 + 1 KV heads, 6 + 3 query heads). A tiny vocabulary (7) does not
divide by 2: the vocabulary-parallel embedding and head pad their last shard.
"""
from __future__ import annotations

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.models.decoder import DecoderLayer, DecoderLM
from drafttree.models.random_shapes import SHAPES, projections
from drafttree.parallel.shard import check_size, head_rows, valid_sizes
from tests.helpers import every_round, make_prompts
from tests.tp_helpers import fake_group, mixed, sharded


@pytest.mark.parametrize("shape", ["llama-mqa", "qwen3", "llama-gqa3"])
@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_tp2_gives_tp1_tokens(zoo, shape, spec):
    pair = zoo(shape)
    prompts = make_prompts(pair.vocab)
    want = pair.llm(spec).generate(prompts, mixed())
    with sharded(pair, spec) as llm:
        assert llm.engine.world == 2
        # rank 0's pool: 1 of 1, 1 of 2, 2 of 3
        assert llm.engine.runner.kv.k.shape[2] == {"llama-mqa": 1, "qwen3": 1, "llama-gqa3": 2}[shape]
        got = llm.generate(prompts, mixed())
        again = llm.generate(prompts[:1], mixed()[:1])   # its pages from the prefix cache this time
        assert llm.engine.agree()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.metrics["accept_lengths"] == w.metrics["accept_lengths"]   # the same drafts, accepted alike
    assert again[0].token_ids == want[0].token_ids
    if spec != "none":
        assert max(t for o in got for t in o.metrics["accept_lengths"]) > 1   # speculation really accepted


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_tp2_constrained_and_processed_rows_give_plain_tp1_tokens(tmp_path, spec):
    """Rank 0 grows a constrained round's trees on its host and the followers verify the trees it
    sends; processed rows (log-probabilities, penalties) run their own round kind on every rank."""
    pytest.importorskip("llguidance", reason="structured outputs run on llguidance (a dependency)")
    from drafttree.structured.params import StructuredOutputs
    from tests.tiny import make_drafter, make_target, write_tokenizer
    target = write_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=128, scale=3.0), 128, eos_token="<extra_0>")
    drafter = make_drafter(tmp_path / "d", target, block_size=4)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"enum": ["xy", "zzz"]}}, "required": ["a", "b"]}
    prompts = ["hello world", "abc q xyz", "foo foo hello"]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(json=schema)),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(regex="[a-z]{3,9} [0-9]+")),
              SamplingParams(temperature=0, max_tokens=30, logprobs=2, presence_penalty=0.5, ignore_eos=True)]
    kw = dict(model=str(target), device="cpu", dtype="float32", max_num_seqs=3, max_model_len=128)
    plain = LLM(spec="none", **kw)
    want = plain.generate(prompts, params)
    plain.shutdown()
    llm = LLM(draft_model=str(drafter), spec=spec, budget=every_round(spec, None), tensor_parallel_size=2, **kw)
    try:
        got = llm.generate(prompts, params)
        assert llm.engine.agree()
        assert llm.engine.constrained.times.rounds > 0   # the trees were the host's
    finally:
        llm.shutdown()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
    g, w = got[2].outputs[0], want[2].outputs[0]
    assert len(g.logprobs) == 30 and [list(e) for e in g.logprobs] == [list(e) for e in w.logprobs]
    assert [e[t].logprob for e, t in zip(g.logprobs, g.token_ids)] == \
        pytest.approx([e[t].logprob for e, t in zip(w.logprobs, w.token_ids)], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_default_model_sharded_gives_tp1_tokens(world):
    """SmolLM2-135M has 9 heads and 3 KV heads: 3 ranks hold a group each, 2 ranks two and one."""
    from drafttree.loader.default_model import default_gguf_path
    try:
        default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    kw = dict(spec="ddtree", budget=8, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    chat = [{"role": "user", "content": "Write quicksort in Python."}]
    want = LLM(**kw).chat(chat, params)[0]
    sharded_llm = LLM(tensor_parallel_size=world, **kw)
    try:
        got = sharded_llm.chat(chat, params)[0]
        assert sharded_llm.engine.agree()
    finally:
        sharded_llm.shutdown()
    assert got.token_ids == want.token_ids and got.metrics["accept_lengths"] == want.metrics["accept_lengths"]


# -- shapes (no processes) ------------------------------------------------------------------------

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


def test_uneven_split_by_kv_groups():
    """Sizes up to the KV heads split them by whole groups, the first ranks one more; larger sizes
    keep the even rules (divide the query heads, a multiple of the KV heads), others are refused."""
    from drafttree.models.kv_cache import KVLayout

    cfg = SHAPES["smollm2-135m"][0]   # 9 heads, 3 KV heads of 64
    assert valid_sizes(cfg, 12) == [1, 2, 3]
    assert head_rows(cfg, 0, 2) == (slice(0, 6 * 64), slice(0, 2 * 64))
    assert head_rows(cfg, 1, 2) == (slice(6 * 64, 9 * 64), slice(2 * 64, 3 * 64))
    assert [KVLayout.of(cfg, 2, r).kv_heads for r in range(2)] == [2, 1]
    assert projections(cfg, 2, 1) == {"qkv": (5 * 64, 576), "o": (576, 3 * 64), "gate_up": (2 * 768, 576),
                                      "down": (576, 768)}
    with torch.device("meta"):
        layer = DecoderLayer(cfg, fake_group(1, 2))
    assert tuple(layer.self_attn.o_proj.weight.shape) == (576, 3 * 64)
    check_size(cfg, 2)
    with pytest.raises(ValueError, match="does not divide the 9 attention heads"):
        check_size(cfg, 4)
    # the even rules stand: Qwen3-8B at 16 ranks replicates its 8 KV heads, and 12 is refused
    big = SHAPES["qwen3-8b"][0]
    check_size(big, 16)
    with pytest.raises(ValueError):
        check_size(big, 12)
    assert head_rows(big, 2, 3) == (slice(24 * 128, 32 * 128), slice(6 * 128, 8 * 128))   # 3 + 3 + 2 KV heads


# -- lifetimes ------------------------------------------------------------------------------------

def test_one_tensor_parallel_engine_at_a_time_and_closing_one_spares_the_next(zoo):
    """A second engine while one lives is refused at once (before a rank is spawned); the first
    goes on. An engine dropped without shutdown is collected by the next one's start, and its
    late close (a finalizer, after the newer engine started) leaves the newer one's group alone."""
    import gc
    import time

    from drafttree.parallel.group import close_group

    pair = zoo("qwen3")
    kw = dict(model=str(pair.target), spec="none", device="cpu", dtype="float32", max_num_seqs=1, max_model_len=32,
              tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = LLM(**kw)
    want = first.generate([[1, 2, 3]], params)[0].token_ids
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="another tensor-parallel engine lives in this process"):
        LLM(**kw)
    assert time.monotonic() - t0 < 2.0
    assert first.generate([[1, 2, 3]], params)[0].token_ids == want
    old = first.engine.tp
    gc.disable()   # what the dropped engine leaves is collected when the next one starts
    try:
        first = None
        second = LLM(**kw)
    finally:
        gc.enable()
    with second:
        close_group(old)   # the first's close, late
        assert second.generate([[1, 2, 3]], params)[0].token_ids == want
