"""load_tokenizer: which backend a folder or file gets, and clear errors for bad paths."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import llama_models
import pytest
import sentencepiece

from jaxllama.text.gguf_vocab import tokenizer_files_from_gguf
from jaxllama.text.hf_tokenizer import HFTokenizer
from jaxllama.text.loading import load_tokenizer
from jaxllama.text.sentencepiece_tokenizer import SentencePieceTokenizer
from jaxllama.text.tiktoken_tokenizer import Llama3Tokenizer, is_tiktoken_bpe_file
from tests.helpers.text import train_sentencepiece, write_gguf_vocab

LLAMA3_MODEL = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), model_type="bpe")


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json or tokenizer.model") as error:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(error.value)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="expected a folder or a .gguf file"):
        load_tokenizer(path)


def test_tokenizer_model_kinds(spm_folder, tmp_path):
    assert is_tiktoken_bpe_file(LLAMA3_MODEL)
    assert not is_tiktoken_bpe_file(spm_folder / "tokenizer.model")
    assert isinstance(load_tokenizer(spm_folder), SentencePieceTokenizer)
    shutil.copy(LLAMA3_MODEL, tmp_path)
    assert isinstance(load_tokenizer(tmp_path), Llama3Tokenizer)


def test_tokenizer_json_is_preferred(spm_folder, tmp_path):
    """A folder with both files (as HF repos of sentencepiece models have) uses tokenizer.json."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm_folder / "tokenizer.model"))
    gguf_path = write_gguf_vocab(processor, tmp_path / "vocab.gguf")
    folder = tmp_path / "both"
    folder.mkdir()
    shutil.copy(spm_folder / "tokenizer.model", folder)
    for name, text in tokenizer_files_from_gguf(gguf.GGUFReader(gguf_path)).items():
        (folder / name).write_text(text, encoding="utf-8")
    loaded = load_tokenizer(folder)
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode("hello world") == processor.encode("hello world")


def test_unsupported_gguf_vocabulary(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "bert.gguf", arch="bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "hello"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'bert' is not supported"):
        load_tokenizer(tmp_path / "bert.gguf")
