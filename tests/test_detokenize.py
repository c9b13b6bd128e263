"""Incremental detokenization and stop strings match a full decode of the output."""
from __future__ import annotations

import random

import pytest

from drafttree.engine.sequence import Sequence
from drafttree.engine.text import TextCodec
from drafttree.sampling import SamplingParams

TEXT = "Héllo wörld! 你好，世界 🙂🙂 def quicksort(arr):\n    return sorted(arr)  # ünïcödé ✓✓ END tail"


@pytest.fixture(scope="module")
def detok():
    try:
        from drafttree.loader.default_model import default_model_dir
        path = default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return TextCodec(tok, {2}, len(tok))


def feed(host, params: SamplingParams, ids: list[int], seed: int) -> Sequence:
    rng = random.Random(seed)
    seq = Sequence([1], params)
    i = 0
    while i < len(ids) and not seq.finished:
        k = rng.randint(1, 5)
        seq.output_ids.extend(ids[i:i + k])
        i += k
        if i >= len(ids):
            seq.finish("length")
        host.detokenize(seq)
    return seq


def test_incremental_text_equals_full_decode(detok):
    ids = detok.tokenizer.encode(TEXT, add_special_tokens=False)
    for seed in range(25):
        seq = feed(detok, SamplingParams(max_tokens=1000), ids, seed)
        assert seq.text == detok.tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_cuts_text(detok):
    ids = detok.tokenizer.encode(TEXT, add_special_tokens=False)
    for seed in range(10):
        seq = feed(detok, SamplingParams(max_tokens=1000, stop=["END", "nothing-like-this"]), ids, seed)
        assert seq.finish_reason == "stop" and seq.text == TEXT[:TEXT.index("END")]
