"""SmolLM2's GGUF vocabulary (byte-level BPE, pre-tokenizer "smollm") and the HF tokenizer.json backend,
against transformers' tokenizer for the same GGUF file.

transformers' GGUF conversion has no entry for pre-tokenizer "smollm" and splits text like GPT-2. llama.cpp
and SmolLM2's own tokenizer.json first isolate each digit, which changes how whitespace runs before a digit
are cut ("a  1" -> "a", "ĠĠ", "1" instead of "a", "Ġ", "Ġ1" -> "Ġ", "1"). The reference therefore gets
SmolLM2's published pre-tokenizer; `test_transformers_gguf_split_differs_only_before_digits` pins the rest.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from jaxllama.text.gguf_vocab import tokenizer_files_from_gguf
from jaxllama.text.hf_tokenizer import HFTokenizer
from jaxllama.text.loading import load_tokenizer
from tests.helpers.text import MULTIBYTE_TEXTS, any_token, assert_streams_like_decode

TEXTS = [
    "",
    " ",
    "Hello world! 123",
    "  multiple   spaces  and trailing ",
    "tabs\tand\t\ttabs, new\nlines\n\n\nand\r\nCRLF \n \n",
    "naïve café, Ünïcödé façade, ß, İstanbul",
    "東京タワーは日本の電波塔です。中文字符 한국어",
    "emoji 😀 👩‍👩‍👧‍👦 🏳️‍🌈 ✌🏽 🇫🇷 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "digits 1 12 123 1234 12345678901234567890 3.14159 a1b22c333, x  1\n\n2\t\t3",
    "I'm sure you'll see it's HE'S and We'VE, they'd",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint({'a': [1, 2]})\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep><|not_special|>",
]


@pytest.fixture(scope="module")
def reader(smollm2_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_path)


@pytest.fixture(scope="module")
def files(reader) -> dict[str, str]:
    return tokenizer_files_from_gguf(reader)


@pytest.fixture(scope="module")
def tokenizer(files) -> HFTokenizer:
    return HFTokenizer(files)


@pytest.fixture(scope="module")
def transformers_gguf(transformers_smollm2_tokenizer):
    """transformers' tokenizer built from the same GGUF file (tests/conftest.py)."""
    return transformers_smollm2_tokenizer


@pytest.fixture(scope="module")
def gpt2_split(transformers_gguf) -> tokenizers.Tokenizer:
    """A copy of transformers' GGUF tokenizer as it is, splitting like GPT-2."""
    return tokenizers.Tokenizer.from_str(transformers_gguf.backend_tokenizer.to_str())


@pytest.fixture(scope="module")
def reference(transformers_gguf, gpt2_split):
    """transformers' GGUF tokenizer with SmolLM2's published pre-tokenizer (digits isolated first): a copy, the
    session's stays as transformers built it."""
    reference = copy.deepcopy(transformers_gguf)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


@pytest.fixture(scope="module")
def converted_folder(files, tmp_path_factory) -> Path:
    """The files as the converter writes them into a checkpoint."""
    folder = tmp_path_factory.mktemp("converted")
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_equal_transformers(tokenizer, reference, text):
    ids = reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True)


def test_transformers_gguf_split_differs_only_before_digits(tokenizer, gpt2_split):
    digit_after_spaces = re.compile(r"\s\s\d")
    for text in TEXTS:
        if not digit_after_spaces.search(text):
            assert tokenizer.encode(text) == gpt2_split.encode(text, add_special_tokens=False).ids
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("a  1")] == ["a", "ĠĠ", "1"]
    assert gpt2_split.encode("a  1").tokens == ["a", "Ġ", "Ġ", "1"]


@pytest.mark.parametrize("text", TEXTS[-3:])
def test_special_text_as_plain_text(tokenizer, reference, text):
    plain = reference(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tokenizer.encode(text, allow_special=False) == plain
    assert not set(plain) & set(tokenizer.special_tokens.values())
    assert tokenizer.decode(plain) == text


def test_attributes(tokenizer, reference):
    assert tokenizer.vocab_size == len(reference) == 49_152
    assert (tokenizer.bos_token, tokenizer.bos_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_id) == ("<|im_end|>", 2)
    assert tokenizer.add_bos is False  # tokenizer.ggml.add_bos_token
    assert tokenizer.special_tokens == {reference.convert_ids_to_tokens(i): i for i in range(17)}
    assert tokenizer.encode("hi", add_bos=True) == [1, *reference.encode("hi", add_special_tokens=False)]
    assert tokenizer.id_to_token(tokenizer.encode(" hello")[0]) == "Ġhello"
    assert tokenizer.token_to_id("Ġhello") == reference.convert_tokens_to_ids("Ġhello")


def test_tokenizer_config(files, reader):
    config = json.loads(files["tokenizer_config.json"])
    template = reader.fields["tokenizer.chat_template"].contents()
    assert config["chat_template"] == template
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)


def test_converted_folder_loads_the_same(converted_folder, tokenizer):
    loaded = load_tokenizer(converted_folder)
    assert isinstance(loaded, HFTokenizer)
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
    attributes = ("vocab_size", "bos_id", "eos_id", "bos_token", "eos_token", "special_tokens", "add_bos")
    assert {a: getattr(loaded, a) for a in attributes} == {a: getattr(tokenizer, a) for a in attributes}


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60))
def test_random_text_equals_transformers(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == reference.decode(ids)


@pytest.mark.parametrize("text", [*MULTIBYTE_TEXTS, TEXTS[11]])
def test_incremental_decoding(tokenizer, text):
    for skip_special in (False, True):
        assert_streams_like_decode(tokenizer, tokenizer.encode(text), skip_special=skip_special)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special=st.booleans())
def test_incremental_decoding_of_random_ids(tokenizer, data, skip_special):
    ids = data.draw(st.lists(any_token(tokenizer), max_size=40))
    assert_streams_like_decode(tokenizer, ids, skip_special=skip_special)


# --- HF tokenizer.json folders, as transformers saves them ---


@pytest.fixture(scope="module")
def saved_folder(reference, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved")
    reference.save_pretrained(folder)
    return folder


def test_saved_transformers_folder(saved_folder, reference):
    loaded = load_tokenizer(saved_folder)
    assert isinstance(loaded, HFTokenizer)
    assert (loaded.bos_token, loaded.eos_token, loaded.add_bos) == ("<|im_start|>", "<|im_end|>", False)
    for text in TEXTS:
        assert loaded.encode(text) == reference.encode(text)
        assert loaded.encode(text, add_bos=True) == [loaded.bos_id, *reference.encode(text)]


def test_bos_from_post_processor(saved_folder, tmp_path):
    """No tokenizer_config.json: BOS and add_bos come from the post-processor's template, and
    encode(add_bos=...) decides alone whether BOS is added (never twice)."""
    from transformers import AutoTokenizer

    spec = json.loads((saved_folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_token, loaded.bos_id, loaded.add_bos, loaded.eos_token) == ("<|endoftext|>", 0, True, None)

    reference = AutoTokenizer.from_pretrained(saved_folder, tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in ["hello world", "<|endoftext|>hi", ""]:
        assert loaded.encode(text, add_bos=True) == reference.encode(text) == [0, *loaded.encode(text)]
        assert loaded.encode(text) == reference.encode(text, add_special_tokens=False)


def test_bos_token_as_added_token_dict(saved_folder, tmp_path):
    """tokenizer_config.json may spell a token as an AddedToken dict, and set add_bos_token."""
    (tmp_path / "tokenizer.json").write_bytes((saved_folder / "tokenizer.json").read_bytes())
    config = {
        "bos_token": {"content": "<|endoftext|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_token, loaded.bos_id, loaded.eos_id, loaded.add_bos) == ("<|endoftext|>", 0, 2, True)
    assert loaded.encode("hi") == HFTokenizer.from_folder(saved_folder).encode("hi")


def test_special_tokens_map_fills_in_for_tokenizer_config(saved_folder, tmp_path):
    """Older repos keep bos/eos in special_tokens_map.json; tokenizer_config.json wins where both say."""
    (tmp_path / "tokenizer.json").write_bytes((saved_folder / "tokenizer.json").read_bytes())
    special_tokens_map = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}), encoding="utf-8")
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_token, loaded.bos_id, loaded.eos_token, loaded.eos_id) == ("<|endoftext|>", 0, "<|im_end|>", 2)
    assert loaded.add_bos is False
