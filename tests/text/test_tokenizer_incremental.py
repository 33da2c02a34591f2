"""IncrementalDecoder: streamed pieces join to exactly `decode(all ids)`, never splitting a character.

Backends here: Meta's Llama 3 vocabulary (tiktoken), a sentencepiece model trained in the test, and
the same model's vocabulary read back from GGUF (HF backend, whose byte fallback decodes a run of
byte tokens as a whole). test_tokenizer_gguf.py runs the same checks on SmolLM2's vocabulary.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import llama_models
import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllama.text.loading import load_tokenizer
from jaxllama.text.sentencepiece_tokenizer import SentencePieceTokenizer
from jaxllama.text.tokenizer import Tokenizer
from tests.helpers.text import (
    MULTIBYTE_TEXTS,
    REPLACEMENT_CHAR,
    any_token,
    assert_streams_like_decode,
    train_sentencepiece,
    write_gguf_vocab,
)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("llama3")
    shutil.copy(Path(llama_models.__file__).parent / "llama3" / "tokenizer.model", folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), model_type="bpe")


@pytest.fixture(scope="module")
def spm(spm_folder) -> Tokenizer:
    return load_tokenizer(spm_folder)


@pytest.fixture(scope="module")
def spm_gguf(spm_folder) -> Tokenizer:
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm_folder / "tokenizer.model"))
    return load_tokenizer(write_gguf_vocab(processor, spm_folder / "vocab.gguf"))


@pytest.fixture(params=["llama3", "spm", "spm_gguf"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_of_encoded_text(tokenizer, text, skip_special):
    assert_streams_like_decode(tokenizer, tokenizer.encode(text, add_bos=True), skip_special=skip_special)


def test_characters_split_across_tokens_come_out_whole(tokenizer):
    emoji = tokenizer.encode("😀")
    assert len(emoji) > 1, "the emoji should take several byte tokens in this vocabulary"
    pieces = assert_streams_like_decode(tokenizer, tokenizer.encode("ok 😀 ok"))
    assert [piece for piece in pieces if "😀" in piece] and not any(REPLACEMENT_CHAR in p for p in pieces)


def test_bytes_that_never_complete_come_out_on_flush(tokenizer):
    ids = tokenizer.encode("a😀")[:-1]  # drop the emoji's last byte token
    decoder = tokenizer.incremental_decoder()
    streamed = "".join(decoder.push(i) for i in ids)
    assert REPLACEMENT_CHAR not in streamed
    rest = decoder.flush()
    assert rest.startswith(REPLACEMENT_CHAR)
    assert streamed + rest == tokenizer.decode(ids)


def test_special_tokens_in_the_stream(tokenizer):
    special = tokenizer.eos_token
    text = f"Bonjour 😀{special} après{special}"
    ids = tokenizer.encode(text, add_bos=True)
    assert assert_streams_like_decode(tokenizer, ids, skip_special=False)
    assert "".join(assert_streams_like_decode(tokenizer, ids, skip_special=True)).count(special) == 0


def test_long_runs_of_byte_tokens(tokenizer):
    """The window is cut inside runs of byte tokens; it must not start inside a character."""
    for text in ["€" * 40, "😀" * 30, "a€😀" * 20, "タワー" * 20]:
        assert_streams_like_decode(tokenizer, tokenizer.encode(text))


@pytest.mark.parametrize("skip_special", [False, True])
def test_specials_between_words(tokenizer, skip_special):
    """Skipped specials decode to nothing; the window must not be cut to one of them alone."""
    word_then_special = [*tokenizer.encode(" word"), tokenizer.eos_id]
    assert_streams_like_decode(tokenizer, word_then_special * 40, skip_special=skip_special)


def test_long_stream_decodes_a_bounded_window(spm_folder):
    """O(1) per token: the window passed to decode stays short however long the stream gets."""
    window_sizes: list[int] = []

    class Recording(SentencePieceTokenizer):
        def decode(self, ids, *, skip_special=False):
            ids = list(ids)
            window_sizes.append(len(ids))
            return super().decode(ids, skip_special=skip_special)

    recording = Recording(spm_folder / "tokenizer.model")
    ids = recording.encode(" ".join(MULTIBYTE_TEXTS) * 40)
    assert len(ids) > 2000
    assert_streams_like_decode(recording, ids)
    assert max(window_sizes[:-1]) <= 64  # the last entry is the whole-sequence decode


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40))
def test_random_text_streams_like_decode_llama3(llama3, text):
    assert_streams_like_decode(llama3, llama3.encode(text))


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40))
def test_random_text_streams_like_decode_sentencepiece(spm, text):
    assert_streams_like_decode(spm, spm.encode(text))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special=st.booleans())
def test_random_ids_stream_like_decode(llama3, spm, spm_gguf, data, skip_special):
    """Arbitrary id sequences: stray byte tokens, specials, broken UTF-8."""
    for tokenizer in (llama3, spm, spm_gguf):
        ids = data.draw(st.lists(any_token(tokenizer), max_size=40))
        assert_streams_like_decode(tokenizer, ids, skip_special=skip_special)
