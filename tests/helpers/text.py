"""Tokenizers made in the tests (a sentencepiece model trained on a generated corpus, its vocabulary as a GGUF
file) and the check that a tokenizer's stream of pieces joins to its decode, shared by the text tests."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import sentencepiece
from hypothesis import strategies as st

from jaxllama.text.tokenizer import Tokenizer

USER_DEFINED = "<tool>"
WORDS = (
    "the quick brown fox jumps over lazy dog hello world tokenizer café naïve 東京 日本語 ünïcödé "
    "data model jax llama 12345 6789 x=y+1; (a,b) {c} def return"
).split()


def train_sentencepiece(folder: Path, *, model_type: str, vocab_size: int = 500, add_dummy_prefix: bool = True) -> Path:
    """Train a small byte-fallback model on a generated corpus; returns `folder` with tokenizer.model."""
    rng = random.Random(0)
    lines = [
        rng.choice([" ", "  ", "\t", "   "]).join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        for _ in range(3000)
    ]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tokenizer"),
        model_type=model_type,
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=[USER_DEFINED],
        minloglevel=2,
    )
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    return folder


def write_gguf_vocab(sp: sentencepiece.SentencePieceProcessor, path: Path, *, add_space_prefix: bool = True) -> Path:
    """The model's vocabulary as a GGUF file with tokenizer.ggml.model "llama", as llama.cpp writes it."""

    def token_type(i: int) -> gguf.TokenType:
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        if sp.id_to_piece(i) == USER_DEFINED:
            return gguf.TokenType.USER_DEFINED
        return gguf.TokenType.NORMAL

    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([token_type(i) for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


REPLACEMENT_CHAR = "\ufffd"
# Multi-byte characters that vocabularies split into several (byte) tokens.
MULTIBYTE_TEXTS = [
    "héllo wörld ñ",
    "東京タワーは日本の電波塔です。",
    "emoji 👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, ✌🏽 skin tone, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "mixed: Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย, 한국어",
    "  leading spaces\tand\ttabs\n\nnew lines  ",
    "€ 😀 ∑ 𝄞 \U0010ffff",
]


def assert_streams_like_decode(tokenizer: Tokenizer, ids: list[int], *, skip_special: bool = False) -> list[str]:
    """Push `ids` one by one; check the pieces against the whole-sequence decode. Returns the pieces."""
    decoder = tokenizer.incremental_decoder(skip_special=skip_special)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    full = tokenizer.decode(ids, skip_special=skip_special)
    assert "".join(pieces) == full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    return pieces


def any_token(tokenizer: Tokenizer) -> st.SearchStrategy[int]:
    """Ids of any kind, with the low ids (single bytes in these vocabularies) and specials drawn often."""
    return st.one_of(
        st.integers(0, 300),
        st.integers(0, tokenizer.vocab_size - 1),
        st.sampled_from(sorted(tokenizer.special_tokens.values())),
    )
