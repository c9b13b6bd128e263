"""A GGUF's byte-level BPE tokenizer built from the header drafttree already read.

transformers converts a GGUF's tokenizer by reading the file again (older releases with gguf's
GGUFReader over every metadata element, seconds), and what it builds depends on its release: some
give a byte-level vocabulary SentencePiece's decoder and the wrong end-of-sequence token. A
byte-level BPE tokenizer is fully given by the metadata: the vocabulary, the merges, the token
types and the special tokens' ids. This builds it with `tokenizers` and saves it through
transformers' class, the same files under any release, and file for file what a current
`AutoTokenizer.from_pretrained(gguf_file=)` saves (a test holds it to that). Only vocabularies
split as GPT-2 splits (`PLAIN_BYTE_LEVEL`) that add no BOS or EOS are built here; any other goes
to transformers.
"""
from __future__ import annotations

import functools
from typing import Any

# `tokenizer.ggml.pre` values whose text is split by GPT-2's own byte-level regex (transformers adds
# no split of its own for them)
PLAIN_BYTE_LEVEL = frozenset({"smollm", "gpt2", "default"})
CONTROL, USER_DEFINED = 3, 4   # llama.cpp's token types


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters: the printable Latin-1 bytes stand for
    themselves, every other byte for a character past 255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def builds(meta: dict[str, Any]) -> bool:
    """Whether `build` makes this file's tokenizer (else transformers converts it)."""
    return meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre", "default") in PLAIN_BYTE_LEVEL \
        and "tokenizer.ggml.merges" in meta and not meta.get("tokenizer.ggml.add_bos_token", False) \
        and not meta.get("tokenizer.ggml.add_eos_token", False)


def build(meta: dict[str, Any]) -> Any:
    """The tokenizer (a transformers `PreTrainedTokenizerFast`) of a GGUF's metadata `meta` (the
    header's fields) for which `builds` holds."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    if not builds(meta):
        raise ValueError("not a byte-level BPE vocabulary with GPT-2's split: transformers converts it")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", ())]
    spell = byte_alphabet()
    alphabet = set(spell.values())
    # a token outside the byte alphabet is stored as its text: respelled, as the merges spell it
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    # control tokens stay whole and special (one spelled outside the byte alphabet is a mislabel
    # that would grow the vocabulary past the model's); user-defined ones whole, not special
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[int(i)]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special("bos_token_id"),
                                   eos_token=special("eos_token_id"), unk_token=special("unknown_token_id"),
                                   pad_token=special("padding_token_id"))
