"""On two GPUs: the seed's deployment shape at TP=2. Block 8, budget 32: every rank captures its
verify graphs at 33 tokens (not the draft's 8) and every prefill graph of the scheduler's rule at
start-up, with NCCL's collectives inside, and the engine answers its first request from those
graphs; at fp32 its tokens are TP=1's.
"""
from __future__ import annotations

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.phases import Phase
from tests.tiny import make_drafter, make_target

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 CUDA devices")]
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 8]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-gpu")
    target = make_target(root / "target", "qwen3", vocab=97, scale=3.0)   # 4 heads, 2 KV heads: one per rank
    return target, make_drafter(root / "drafter", target, block_size=8)


def seed_llm(pair, dtype: str, tp: int) -> LLM:
    target, drafter = pair
    return LLM(model=str(target), draft_model=str(drafter), spec="ddtree", budget=32, device="cuda", dtype=dtype,
               max_num_seqs=2, max_model_len=256, tensor_parallel_size=tp)


def test_seed_configuration_at_tp2_captures_verify_at_33_and_answers(pair):
    llm = seed_llm(pair, "bfloat16", 2)
    try:
        eng = llm.engine
        assert eng.world == 2 and eng.spec.width(Phase.DRAFT) == 8 and eng.spec.width(Phase.VERIFY, 1, 32) == 33
        graphs = eng.runner.graphs
        verify = [k for k in graphs.graphs if k[0] is Phase.VERIFY]
        assert verify and {k[4] for k in verify} == {32}
        assert {tree.num_nodes for tree in graphs.trees.values()} == {33}   # the tree each verify graph reads
        prefill = eng.runner.prefill_graphs
        assert not prefill.failed and set(prefill.graphs) == set(prefill.shapes())   # all at start-up
        out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        assert [len(o.token_ids) for o in out] == [48, 48]
        assert graphs.fallbacks == 0, "a round ran eagerly: no graph for its shape"
        assert prefill.fallbacks == 0, "a prefill ran eagerly: no graph for its shape"
        assert eng.agree()   # every rank committed the same tokens
        sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True))
        assert [len(o.token_ids) for o in sampled] == [16, 16] and graphs.fallbacks == 0
        assert eng.agree()
    finally:
        llm.shutdown()


def test_tp2_gives_tp1_tokens_at_fp32_through_graphs(pair):
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=32, ignore_eos=True)]
    one = seed_llm(pair, "float32", 1)
    want = one.generate(PROMPTS, params)
    del one
    torch.cuda.empty_cache()
    two = seed_llm(pair, "float32", 2)
    try:
        got = two.generate(PROMPTS, params)
        assert two.engine.runner.graphs.fallbacks == 0 and two.engine.agree()
    finally:
        two.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
