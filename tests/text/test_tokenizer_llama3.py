"""Meta's Llama 3 tokenizer.model (tiktoken ranks) against Meta's reference tokenizer in llama_models."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import llama_models
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

from jaxllama.text.loading import load_tokenizer
from jaxllama.text.tiktoken_tokenizer import Llama3Tokenizer

MODEL_FILE = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  two leading spaces, trailing   ",
    "tabs\tand\t\ttabs, new\nlines\n\n\nand\r\nCRLF \n \n",
    "naïve café, Ünïcödé façade, ß, İstanbul",
    "東京タワーは日本の電波塔です。中文字符，韩国어 한국어",
    "emoji 😀 👩‍👩‍👧‍👦 🏳️‍🌈 ✌🏽 🇫🇷 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "digits 1 12 123 1234 12345678901234567890 3.14159 1,000,000",
    "I'm sure you'll see it's HE'S and We'VE, they'd",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint({'a': [1, 2]})\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    "<|python_tag|>call()<|eom_id|><|reserved_special_token_17|><|finetune_right_pad_id|>",
    "<|not_a_special|> <|eot_id",
    " " * 30_000 + "x" * 30_000 + "\n" * 3,  # runs longer than Meta's 25k-character cut
]


@pytest.fixture(scope="module")
def reference() -> MetaTokenizer:
    return MetaTokenizer(MODEL_FILE)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Llama3Tokenizer:
    folder = tmp_path_factory.mktemp("llama3")
    shutil.copy(MODEL_FILE, folder)
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, Llama3Tokenizer)
    return tokenizer


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("allow_special", [True, False])
def test_ids_equal_meta(tokenizer, reference, text, allow_special):
    allowed = "all" if allow_special else set()
    expected = reference.encode(text, bos=False, eos=False, allowed_special=allowed)
    assert tokenizer.encode(text, allow_special=allow_special) == expected
    assert tokenizer.encode(text, add_bos=True, allow_special=allow_special) == reference.encode(
        text, bos=True, eos=False, allowed_special=allowed
    )


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_decode_round_trips(tokenizer, reference, text):
    ids = tokenizer.encode(text, add_bos=True)
    assert tokenizer.decode(ids) == reference.decode(ids) == "<|begin_of_text|>" + text
    specials = re.compile("|".join(map(re.escape, tokenizer.special_tokens)))
    assert tokenizer.decode(ids, skip_special=True) == specials.sub("", text)


def test_special_tokens_match_meta(tokenizer, reference):
    assert tokenizer.special_tokens == reference.special_tokens
    assert len(tokenizer.special_tokens) == 256
    assert tokenizer.vocab_size == reference.n_words == 128_256
    assert (tokenizer.bos_id, tokenizer.bos_token) == (128_000, "<|begin_of_text|>")
    assert (tokenizer.eos_id, tokenizer.eos_token) == (128_001, "<|end_of_text|>")
    assert tokenizer.token_to_id("<|eom_id|>") == 128_008
    assert tokenizer.token_to_id("<|eot_id|>") == 128_009
    assert tokenizer.add_bos is True


def test_token_spelling(tokenizer, reference):
    """Ordinary tokens are spelled byte-level, as in HF's Llama 3 tokenizer.json."""
    (hello,) = reference.encode(" hello", bos=False, eos=False)
    assert tokenizer.id_to_token(hello) == "Ġhello"
    assert tokenizer.token_to_id("Ġhello") == hello
    assert tokenizer.id_to_token(128_009) == "<|eot_id|>"
    assert tokenizer.token_to_id("no such token") is None
    for i in [0, 1000, 50_000, 127_999]:
        assert tokenizer.token_to_id(tokenizer.id_to_token(i)) == i
    with pytest.raises(KeyError):
        tokenizer.id_to_token(128_256)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60), allow_special=st.booleans())
def test_random_text_equals_meta(tokenizer, reference, text, allow_special):
    allowed = "all" if allow_special else set()
    ids = tokenizer.encode(text, allow_special=allow_special)
    assert ids == reference.encode(text, bos=False, eos=False, allowed_special=allowed)
    assert tokenizer.decode(ids) == text
