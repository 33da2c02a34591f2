"""Sentencepiece backend and GGUF "llama" vocabularies, against sentencepiece itself.

A small model is trained in the test (byte fallback on, Llama-2-like settings: identity
normalization, dummy prefix, whitespace kept), then written as a GGUF vocabulary too.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllama.text.gguf_vocab import tokenizer_files_from_gguf
from jaxllama.text.hf_tokenizer import HFTokenizer
from jaxllama.text.loading import load_tokenizer
from jaxllama.text.sentencepiece_tokenizer import SentencePieceTokenizer
from tests.helpers.text import USER_DEFINED, train_sentencepiece, write_gguf_vocab

TEXTS = [
    "",
    "hello world",
    " hello",
    "  hello  world  ",
    "the\tquick\n\nbrown fox",
    "東京 日本語 ünïcödé",
    "€ 😀 👩‍👩‍👧‍👦 ∑",
    "x=y+1; (a,b) {c}",
    "12345 6789 3.14",
    "def f(x):\n    return x  # done\n",
    "zzz qqq ßßß",
    "<s> is not special to sentencepiece",
]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm_bpe"), model_type="bpe")


@pytest.fixture(scope="module")
def oracle(bpe_folder) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(bpe_folder / "tokenizer.model"))


@pytest.fixture(scope="module")
def spm(bpe_folder) -> SentencePieceTokenizer:
    tokenizer = load_tokenizer(bpe_folder)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def gguf_path(oracle, tmp_path_factory) -> Path:
    return write_gguf_vocab(oracle, tmp_path_factory.mktemp("spm_gguf") / "vocab.gguf")


@pytest.fixture(scope="module")
def from_gguf(gguf_path) -> HFTokenizer:
    tokenizer = load_tokenizer(gguf_path)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_equal_sentencepiece(spm, oracle, text):
    ids = oracle.encode(text)
    assert spm.encode(text, allow_special=False) == ids
    assert spm.decode(ids) == oracle.decode(ids)


def test_unigram_model_equals_sentencepiece(tmp_path):
    folder = train_sentencepiece(tmp_path, model_type="unigram", vocab_size=350)
    oracle = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokenizer = load_tokenizer(folder)
    for text in TEXTS:
        ids = oracle.encode(text)
        assert tokenizer.encode(text, allow_special=False) == ids
        assert tokenizer.decode(ids) == oracle.decode(ids)


def test_model_without_dummy_prefix(tmp_path):
    """No "▁" is prepended to the text, nor dropped when decoding; the same read from GGUF."""
    folder = train_sentencepiece(tmp_path, model_type="bpe", add_dummy_prefix=False)
    oracle = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokenizer = load_tokenizer(folder)
    from_gguf = load_tokenizer(write_gguf_vocab(oracle, tmp_path / "vocab.gguf", add_space_prefix=False))
    for text in TEXTS:
        ids = oracle.encode(text)
        assert tokenizer.encode(text, allow_special=False) == from_gguf.encode(text, allow_special=False) == ids
        assert tokenizer.decode(ids) == from_gguf.decode(ids) == oracle.decode(ids)
    ids = tokenizer.encode("<s> hello</s> world")
    assert from_gguf.encode("<s> hello</s> world") == ids
    assert tokenizer.decode(ids) == from_gguf.decode(ids) == "<s> hello</s> world"


def test_attributes(spm, oracle):
    assert spm.vocab_size == oracle.get_piece_size() == 500
    assert (spm.bos_id, spm.bos_token) == (oracle.bos_id(), "<s>")
    assert (spm.eos_id, spm.eos_token) == (oracle.eos_id(), "</s>")
    assert spm.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert spm.add_bos is True
    assert spm.token_to_id("▁hello") == oracle.piece_to_id("▁hello")
    assert spm.token_to_id("not a piece") is None
    assert spm.id_to_token(spm.token_to_id("▁hello")) == "▁hello"
    with pytest.raises(KeyError):
        spm.id_to_token(500)


def test_bos_is_added_only_when_asked(spm, oracle):
    assert spm.encode("hello world", add_bos=True) == oracle.encode("hello world", add_bos=True)
    assert spm.encode("hello world") == oracle.encode("hello world")
    assert spm.encode("", add_bos=True) == [spm.bos_id]


def test_special_token_text(spm, oracle):
    """With allow_special, control-token text becomes its id and each text part gets the dummy prefix
    (as llama.cpp and Meta's chat code do); without, it is plain text as sentencepiece reads it."""
    text = "<s>hello</s> world<unk>"
    expected = [1, *oracle.encode("hello"), 2, *oracle.encode(" world"), 0]
    assert spm.encode(text) == expected
    assert spm.encode(text, allow_special=False) == oracle.encode(text)
    assert spm.decode(expected, skip_special=True) == oracle.decode(expected[1:-1]) == "hello  world"
    # Shown specials keep the space that follows them, like HF's and llama.cpp's Llama decoders.
    assert spm.decode(expected) == "<s> hello</s>  world<unk>"


def test_user_defined_piece_is_one_token(spm, oracle):
    assert oracle.piece_to_id(USER_DEFINED) in spm.encode(f"a{USER_DEFINED}b")
    assert USER_DEFINED not in spm.special_tokens


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("abehlorwz  \t\n東京ü€😀<>/s")), max_size=40))
def test_random_text_equals_sentencepiece(spm, from_gguf, oracle, text):
    ids = oracle.encode(text)
    assert spm.encode(text, allow_special=False) == ids
    assert from_gguf.encode(text, allow_special=False) == ids
    assert spm.decode(ids) == from_gguf.decode(ids) == oracle.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_vocab_equals_sentencepiece(from_gguf, oracle, text):
    ids = oracle.encode(text)
    assert from_gguf.encode(text, allow_special=False) == ids
    assert from_gguf.decode(ids) == oracle.decode(ids)


def test_gguf_vocab_equals_sentencepiece_backend_with_specials(from_gguf, spm):
    for text in ["<s>hello</s> world<unk>", "a</s></s>b", " <s> x", "<s>"]:
        ids = spm.encode(text, add_bos=True)
        assert from_gguf.encode(text, add_bos=True) == ids
        for skip_special in (False, True):
            assert from_gguf.decode(ids, skip_special=skip_special) == spm.decode(ids, skip_special=skip_special)


def test_gguf_vocab_attributes(from_gguf, spm, gguf_path):
    assert from_gguf.vocab_size == spm.vocab_size
    assert (from_gguf.bos_id, from_gguf.bos_token) == (spm.bos_id, spm.bos_token)
    assert (from_gguf.eos_id, from_gguf.eos_token) == (spm.eos_id, spm.eos_token)
    assert from_gguf.special_tokens == spm.special_tokens
    assert from_gguf.add_bos is True
    for i in range(spm.vocab_size):
        assert from_gguf.id_to_token(i) == spm.id_to_token(i)
    files = tokenizer_files_from_gguf(gguf.GGUFReader(gguf_path))
    assert '"chat_template": "{{ bos_token }}' in files["tokenizer_config.json"]


def test_gguf_user_defined_token_is_matched_whole(from_gguf, oracle):
    """llama.cpp matches user-defined tokens whole and, like after specials, prefixes the next text part."""
    tool = oracle.piece_to_id(USER_DEFINED)
    assert from_gguf.encode(f"a{USER_DEFINED}b") == [*oracle.encode("a"), tool, *oracle.encode("b")]
    assert from_gguf.encode(USER_DEFINED, allow_special=False) == [tool]
    assert USER_DEFINED not in from_gguf.special_tokens


def test_transformers_reads_the_gguf_vocab_the_same(gguf_path, from_gguf):
    """transformers' own GGUF conversion agrees on text where its conventions match llama.cpp's
    (it adds no "▁" after special tokens, and none before text starting with a space)."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in [t for t in TEXTS if t and not t[0].isspace() and "<s>" not in t]:
        assert from_gguf.encode(text) == reference.encode(text, add_special_tokens=False)
        assert from_gguf.encode(text, add_bos=True) == reference.encode(text)
