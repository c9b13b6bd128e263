"""Checkpoint formats, dtypes and clear refusals of bad input."""
from __future__ import annotations

import json

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.loader.weights import load_target
from tests.tiny import make_target

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("ckpt") / "m", "qwen3", vocab=61, layers=2)


def test_sharded_checkpoint_loads_like_single_file(tiny, tmp_path):
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    a, _ = load_target(tiny, torch.float32, "cpu")
    b, _ = load_target(tmp_path, torch.float32, "cpu")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_decode(tiny, dtype):
    out = LLM(model=str(tiny), device="cpu", dtype=dtype, max_num_seqs=1, max_model_len=64).generate([[1, 2, 3]], GREEDY)
    assert len(out[0].token_ids) == 12


def test_unknown_dtype_refused(tiny):
    with pytest.raises(ValueError, match="unsupported dtype"):
        LLM(model=str(tiny), device="cpu", dtype="int8")


def test_unsupported_architecture_refused(tiny, tmp_path):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(tmp_path), device="cpu")


def test_missing_and_corrupt_files_refused(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_target(tmp_path, torch.float32, "cpu")
    (tmp_path / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes()[:300])
    with pytest.raises(ValueError, match="cannot read"):
        load_target(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_target(tmp_path, torch.float32, "cpu")


def test_wrong_shape_refused(tiny, tmp_path):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="gate_up_proj.weight.*shape"):
        load_target(tmp_path, torch.float32, "cpu")


def test_prompt_longer_than_context_refused_and_nothing_queued(tiny):
    llm = LLM(model=str(tiny), device="cpu", max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match="context holds 32"):
        llm.generate([[1, 2], list(range(1, 40))], GREEDY)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2]], GREEDY)[0].token_ids) == 12


def test_no_eos_runs_to_max_tokens_and_stops_work(tiny):
    llm = LLM(model=str(tiny), device="cpu", max_num_seqs=1, max_model_len=64)
    assert not llm.engine.eos_ids
    full = llm.generate([[4, 5]], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert len(full.token_ids) == 20 and full.finish_reason == "length"
    stop = full.token_ids[7]
    cut = llm.generate([[4, 5]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]))[0]
    assert cut.token_ids == full.token_ids[:full.token_ids.index(stop) + 1] and cut.finish_reason == "stop"


def test_invalid_sampling_params_refused():
    for kw in ({"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_chunked_and_batched_prefill_match_one_request_at_a_time(tiny, tmp_path, spec):
    from tests.tiny import make_drafter
    d = make_drafter(tmp_path / "d", tiny, block_size=4) if spec == "ddtree" else None
    prompts = [[(7 * i + j) % 59 + 1 for j in range(n)] for i, n in enumerate((1, 12, 5, 23))]
    kw = dict(model=str(tiny), draft_model=str(d) if d else None, spec=spec, device="cpu", dtype="float32",
              max_model_len=64)
    alone = [LLM(**kw, max_num_seqs=1).generate([p], GREEDY)[0].token_ids for p in prompts]
    chunked = LLM(**kw, max_num_seqs=4, prefill_chunk=5)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == alone


def test_unknown_engine_argument_refused(tiny):
    with pytest.raises(TypeError, match="budgett"):
        LLM(model=str(tiny), budgett=3)
