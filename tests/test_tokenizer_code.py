"""A tokenizer a model ships as code (Kimi K2's tokenization_kimi.py, on tiktoken): refused without
trust_remote_code before any weight loads, naming the option; with it, the engine tokenizes and
detokenizes through that code, and decodes what a tokenizer.json of the same vocabulary gives,
constrained requests included (tiny random model, CPU)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from drafttree import LLM, SamplingParams
from drafttree.structured.params import StructuredOutputs
from tests.tiny import copy_checkpoint, make_target, write_tokenizer

VOCAB = 128
CODE = Path(__file__).parent / "fixtures" / "tokenization_chars.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(the model with its tokenizer as code, the same weights with the same vocabulary as tokenizer.json)"""
    root = tmp_path_factory.mktemp("code")
    fast = write_tokenizer(make_target(root / "fast", "qwen3", vocab=VOCAB, scale=3.0), VOCAB, eos_token="<extra_0>")
    coded = copy_checkpoint(fast, root / "coded")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (coded / f).unlink(missing_ok=True)
    shutil.copy(CODE, coded / CODE.name)
    (coded / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CharTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_chars.CharTokenizer", None]},
        "unk_token": "<unk>", "eos_token": "<extra_0>"}))
    return coded, fast


def llm(model: Path, **kw) -> LLM:
    return LLM(model=str(model), spec="none", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=96, **kw)


def test_a_tokenizer_that_is_code_is_refused_without_trust_before_the_weights_load(models, monkeypatch):
    import drafttree.engine.engine as engine
    monkeypatch.setattr(engine, "load_models", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(ValueError, match=r"tokenizer is code it ships \(tokenization_chars.CharTokenizer\).*"
                                         r"trust_remote_code \(--trust-remote-code\)"):
        llm(models[0])
    # the setup from the configs alone (`drafttree graphs`, the memory plan) reads no tokenizer
    from drafttree.engine.config import EngineConfig
    from drafttree.engine.plan import resolve
    assert resolve(EngineConfig(model=str(models[0]), spec="none", device="cpu")).model_dir == models[0]


def test_with_trust_the_code_tokenizes_as_the_same_vocabulary_does(models):
    coded, fast = models
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputs(regex="[a-c]{3}-x"))]
    with llm(coded, trust_remote_code=True) as a, llm(fast) as b:
        assert type(a.engine.tokenizer).__name__ == "CharTokenizer"
        got, want = a.generate(["Hello", "abc"], params), b.generate(["Hello", "abc"], params)
        for g, w in zip(got, want):
            assert g.prompt_token_ids == w.prompt_token_ids and g.token_ids == w.token_ids and g.text == w.text
        assert re.fullmatch("[a-c]{3}-x", got[1].text), got[1].text


def test_a_tokenizer_code_that_fails_fails_before_the_weights_load(models, tmp_path, monkeypatch):
    """Code that cannot run here (older Kimi K2 revisions import what transformers 5 removed) is
    reported at once, not after the weights."""
    broken = copy_checkpoint(models[0], tmp_path / "broken")
    (broken / CODE.name).write_text("from transformers.models.gpt2.tokenization_gpt2 import no_such_name\n"
                                    + CODE.read_text())
    import drafttree.engine.engine as engine
    monkeypatch.setattr(engine, "load_models", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(ImportError, match="no_such_name"):
        llm(broken, trust_remote_code=True)
