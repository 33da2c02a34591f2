"""Which tokenizer a folder or a GGUF file holds, loaded with its backend: HF `tokenizers` (tokenizer.json),
sentencepiece (tokenizer.model protobuf), Meta's Llama 3 tiktoken vocabulary (tokenizer.model as "base64token rank"
lines), and GGUF files (their vocabulary turned into tokenizer.json text and loaded with the HF backend). Each
backend is imported only when a path holds its files.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxllama.text.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer stored at `path`: a folder with tokenizer files, or a .gguf file.

    In a folder, tokenizer.json (with tokenizer_config.json) is preferred; otherwise tokenizer.model,
    which is either a sentencepiece model or Meta's Llama 3 tiktoken vocabulary.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}: it does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"cannot load a tokenizer from file {path}: expected a folder or a .gguf file")
        import gguf

        from jaxllama.text.gguf_vocab import tokenizer_files_from_gguf
        from jaxllama.text.hf_tokenizer import HFTokenizer

        return HFTokenizer(tokenizer_files_from_gguf(gguf.GGUFReader(path)))

    if (path / "tokenizer.json").is_file():
        from jaxllama.text.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_folder(path)
    model_file = path / "tokenizer.model"
    if model_file.is_file():
        from jaxllama.text.tiktoken_tokenizer import Llama3Tokenizer, is_tiktoken_bpe_file

        if is_tiktoken_bpe_file(model_file):
            return Llama3Tokenizer(model_file)
        from jaxllama.text.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(model_file)
    raise ValueError(f"no tokenizer in folder {path}: looked for {' or '.join(TOKENIZER_FILES)}")
