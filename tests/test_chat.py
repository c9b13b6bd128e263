"""LLM.chat against generate, the shared chat-template helper, the GGUF conversion's progress and the
warning that explains a context shorter than the model's."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from drafttree import LLM, SamplingParams
from drafttree.loader import default_model
from drafttree.loader.chat_template import apply_chat_template, has_chat_template
from drafttree.loader.gguf_convert import convert_gguf_to_hf
from tests.tiny import make_target

WORDS = ["<unk>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>", "hi", "there", "how", "are", "you"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _save_tokenizer(model_dir: Path, chat_template: str | None) -> None:
    """A word-level tokenizer over the tiny model's first ids, with or without a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(model_dir))


def _llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), spec="none", device="cpu", dtype="float32", max_num_seqs=2,
               max_model_len=128)


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_target(tmp_path_factory.mktemp("chat") / "tiny")
    _save_tokenizer(path, TEMPLATE)
    return _llm(path)


def test_chat_is_generate_on_the_rendered_template(chat_llm: LLM) -> None:
    convo = [{"role": "system", "content": "hi"}, {"role": "user", "content": "how are you"}]
    rendered = "<|system|> hi <|end|> <|user|> how are you <|end|> <|assistant|>"
    assert chat_llm.apply_chat_template(convo) == rendered
    [out] = chat_llm.chat(convo, GREEDY)
    [ref] = chat_llm.generate(rendered, GREEDY)
    assert out.prompt == rendered
    assert out.prompt_token_ids == chat_llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 6


def test_chat_batch_keeps_order_and_generate_stays_raw(chat_llm: LLM) -> None:
    a = [{"role": "user", "content": "hi"}]
    b = [{"role": "user", "content": [{"type": "text", "text": "how are "}, {"type": "text", "text": "you"}]},
         {"role": "assistant", "content": "hi there"}, {"role": "developer", "content": "you"}]
    outs = chat_llm.chat([a, b], [GREEDY, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)])
    assert [o.prompt for o in outs] == [
        "<|user|> hi <|end|> <|assistant|>",
        "<|user|> how are you <|end|> <|assistant|> hi there <|end|> <|system|> you <|end|> <|assistant|>"]
    assert [len(o.token_ids) for o in outs] == [6, 3]
    assert outs[0].token_ids == chat_llm.chat(a, GREEDY)[0].token_ids
    [raw] = chat_llm.generate("hi", GREEDY)
    assert raw.prompt == "hi" and raw.prompt_token_ids == [WORDS.index("hi")]
    no_prompt = chat_llm.chat(a, GREEDY, add_generation_prompt=False)[0]
    assert no_prompt.prompt == "<|user|> hi <|end|> "


def test_chat_continues_the_last_assistant_message_and_shows_the_tools(chat_llm: LLM) -> None:
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "how are"}]
    [out] = chat_llm.chat(convo, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == "<|user|> hi <|end|> <|assistant|> how are"   # the message left open
    with pytest.raises(ValueError, match="cannot both be true"):
        chat_llm.chat(convo, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="last message to be the assistant's, not the user's"):
        chat_llm.chat(convo[:1], GREEDY, add_generation_prompt=False, continue_final_message=True)
    tools = [{"type": "function", "function": {"name": "you", "parameters": {"type": "object"}}}]
    shown = "{% for t in tools %}{{ t.function.name }} {% endfor %}" + TEMPLATE
    [out] = chat_llm.chat(convo[:1], GREEDY, chat_template=shown, tools=tools)
    assert out.prompt == "you <|user|> hi <|end|> <|assistant|>"
    with pytest.raises(ValueError, match=r"may not set \['tools'\]"):
        chat_llm.chat(convo[:1], GREEDY, chat_template_kwargs={"tools": tools})


def test_chat_without_tokenizer_or_template_says_so(tmp_path: Path) -> None:
    bare = _llm(make_target(tmp_path / "bare"))
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.chat([{"role": "user", "content": "hi"}])
    plain_dir = make_target(tmp_path / "plain")
    _save_tokenizer(plain_dir, None)
    plain = _llm(plain_dir)
    assert not has_chat_template(plain.tokenizer)
    with pytest.raises(ValueError, match="no chat template"):
        plain.chat([{"role": "user", "content": "hi"}])
    [out] = plain.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=TEMPLATE)
    assert out.prompt == "<|user|> hi <|end|> <|assistant|>"


def test_an_engines_chat_template_replaces_the_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineConfig.chat_template (vLLM's --chat-template), a file or the text, renders every chat
    of the engine; one that does not compile, or a model without a tokenizer, is refused before the
    weights load, naming it."""
    model_dir = make_target(tmp_path / "m")
    _save_tokenizer(model_dir, None)
    other = TEMPLATE.replace("<|end|> ", "")
    (tmp_path / "t.jinja").write_text(other)
    convo = [{"role": "user", "content": "hi"}]
    for given in (other, str(tmp_path / "t.jinja")):
        with LLM(model=str(model_dir), spec="none", device="cpu", dtype="float32", max_num_seqs=2,
                 max_model_len=128, chat_template=given) as llm:
            assert llm.apply_chat_template(convo) == "<|user|> hi <|assistant|>"
            assert llm.chat(convo, GREEDY)[0].prompt == "<|user|> hi <|assistant|>"
    import drafttree.engine.engine as engine
    monkeypatch.setattr(engine, "load_models", lambda *a, **k: pytest.fail("the weights were loaded"))
    for given, says in (("{% for m in messages %}", "chat_template does not compile as Jinja"),
                        (str(tmp_path / "missing.jinja"), "is neither a file nor a Jinja template")):
        with pytest.raises(ValueError, match=says):
            LLM(model=str(model_dir), spec="none", device="cpu", chat_template=given)
    with pytest.raises(ValueError, match="chat_template needs the model's tokenizer"):
        LLM(model=str(make_target(tmp_path / "bare")), spec="none", device="cpu", chat_template=other)


def test_chat_template_rejections_are_value_errors(chat_llm: LLM) -> None:
    tok = chat_llm.tokenizer
    with pytest.raises(ValueError, match="non-empty list"):
        apply_chat_template(tok, [])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        apply_chat_template(tok, [{"content": "hi"}])
    with pytest.raises(ValueError, match="rejected the messages: no"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}],
                            chat_template="{{ raise_exception('no') }}")
    with pytest.raises(ValueError, match="at least one conversation"):
        chat_llm.chat([])


def _tiny_llama_gguf(path: Path, layers: int = 2) -> Path:
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_context_length(64)
    w.add_vocab_size(10)
    shapes = {"attn_norm": (8,), "attn_q": (8, 8), "attn_k": (8, 8), "attn_v": (8, 8), "attn_output": (8, 8),
              "ffn_norm": (8,), "ffn_gate": (16, 8), "ffn_up": (16, 8), "ffn_down": (8, 16)}
    w.add_tensor("token_embd.weight", rng.standard_normal((10, 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    for i in range(layers):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", rng.standard_normal(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_conversion_shows_a_bar_over_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf_to_hf(src, tmp_path / "out", with_tokenizer=False)
    err = capsys.readouterr().err
    assert (out / "model.safetensors").is_file()
    assert "converting tiny.gguf" in err and "20/20" in err and "done" in err   # 2 + 2 layers x 9
    convert_gguf_to_hf(src, tmp_path / "quiet", with_tokenizer=False, progress=False)
    assert capsys.readouterr().err == ""


def test_first_conversion_says_what_where_and_that_it_is_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path / "cache"))
    src = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        for name in default_model._REQUIRED_FILES:
            (out_dir / name).write_text("{}")
        return out_dir

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", fake_convert)
    model_dir = default_model.converted_gguf_dir(src)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(src.resolve()) in lines[0] and str(model_dir) in lines[0]
    assert "once" in lines[0] and "cache" in lines[0]
    assert default_model.converted_gguf_dir(src) == model_dir and calls == [model_dir]
    assert capsys.readouterr().err == ""


def test_a_context_cut_by_the_kv_budget_is_explained(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = make_target(tmp_path / "tiny")     # max_position_embeddings 512; 768 bytes of KV per token
    gb = (8 * 16 * 768 + 100) / 2**30         # 8 pages of 16: the null page, then 112 slots = 111 + 1 of headroom
    with caplog.at_level(logging.WARNING, logger="drafttree.engine.engine"):
        llm = LLM(model=str(path), spec="none", device="cpu", dtype="float32", max_num_seqs=8,
                  kv_cache_memory_gb=gb)
    assert llm.engine.max_model_len == 111
    [msg] = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert msg.startswith(f"max_model_len 111 < the model's 512: the KV cache budget of {gb:.3g} GiB "
                          "(kv_cache_memory_gb) holds 8 pages of 16 tokens at 768 bytes per token")
    assert "--kv-cache-memory-gb" in msg and "--max-model-len 111" in msg

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="drafttree.engine.engine"):
        llm = LLM(model=str(path), spec="none", device="cpu", dtype="float32", max_num_seqs=8,
                  kv_cache_memory_gb=gb, max_model_len=64)
    assert llm.engine.max_model_len == 64 and not caplog.records


@pytest.mark.slow
def test_chat_on_the_default_model() -> None:
    try:
        model_dir = default_model.default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(f"default model package not installed: {e}")
    llm = LLM(model=str(model_dir), spec="none", device="cpu", dtype="float32", max_num_seqs=1,
              max_model_len=256)
    convo = [{"role": "user", "content": "What is 2+2?"}]
    [out] = llm.chat(convo, SamplingParams(temperature=0.0, max_tokens=8))
    assert out.prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert out.token_ids == llm.generate(out.prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    assert llm.generate("What is 2+2?", SamplingParams(max_tokens=1))[0].prompt_token_ids == \
        llm.tokenizer.encode("What is 2+2?", add_special_tokens=False)
