"""Backend for Meta's Llama 3 tokenizer.model: tiktoken BPE ranks, one "base64token rank" per line.

Matches Meta's reference (llama_models/llama3/tokenizer.py): the same split pattern, 256 special
tokens numbered after the ranks, and the same chunking of long texts before tiktoken sees them.
"""

from __future__ import annotations

import base64
import itertools
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import tiktoken

from jaxllama.text.byte_level import spell, unspell
from jaxllama.text.tokenizer import Tokenizer

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
# tiktoken fails on very long inputs, and BPE is quadratic in the length of one pre-token, so text
# is cut into chunks of at most this many characters, then runs of (non-)whitespace at most this long.
MAX_CHUNK_CHARS = 400_000
MAX_RUN_CHARS = 25_000

_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+")
_RUNS = re.compile(r"\s+|\S+")


def is_tiktoken_bpe_file(path: str | os.PathLike) -> bool:
    """Whether the file starts like tiktoken BPE ranks ("base64token rank" lines), not a protobuf."""
    with open(path, "rb") as f:
        first_line = f.readline(4096)
    return _TIKTOKEN_LINE.fullmatch(first_line.strip()) is not None


def special_token_names() -> list[str]:
    """The 256 special tokens in id order (ids follow the ranks)."""
    reserved = NUM_SPECIAL_TOKENS - len(NAMED_SPECIAL_TOKENS)
    return [*NAMED_SPECIAL_TOKENS, *(f"<|reserved_special_token_{2 + i}|>" for i in range(reserved))]


class Llama3Tokenizer(Tokenizer):
    """Meta's Llama 3 tokenizer. Token text is spelled byte-level ("Ġhello"), as in HF's Llama 3."""

    def __init__(self, model_file: str | os.PathLike):
        self._ranks = _load_ranks(Path(model_file))
        base = len(self._ranks)
        self.special_tokens = {name: base + i for i, name in enumerate(special_token_names())}
        self._encoding = tiktoken.Encoding(
            name=Path(model_file).name,
            pat_str=SPLIT_PATTERN,
            mergeable_ranks=self._ranks,
            special_tokens=self.special_tokens,
        )
        self._special_by_id = {i: name for name, i in self.special_tokens.items()}
        self.vocab_size = base + NUM_SPECIAL_TOKENS
        self.bos_token, self.eos_token = "<|begin_of_text|>", "<|end_of_text|>"
        self.bos_id, self.eos_id = self.special_tokens[self.bos_token], self.special_tokens[self.eos_token]
        self.add_bos = True

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The tiktoken encoding: the ranks, the split pattern and the special tokens."""
        return self._encoding

    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        allowed = "all" if allow_special else set()
        ids: list[int] = []
        for chunk in _chunks(text):
            ids += self._encoding.encode(chunk, allowed_special=allowed, disallowed_special=())
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special_by_id]
        return self._encoding.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        data = unspell(token)
        return self._ranks.get(data) if data is not None else None

    def id_to_token(self, i: int) -> str:
        if i in self._special_by_id:
            return self._special_by_id[i]
        if not 0 <= i < len(self._ranks):
            raise KeyError(f"token id {i} is not in the vocabulary")
        return spell(self._encoding.decode_single_token_bytes(i))


def _load_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank (= id) from "base64token rank" lines."""
    ranks = {}
    for line in path.read_text(encoding="ascii").splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _chunks(text: str) -> Iterator[str]:
    """Meta's cuts: 400k-character chunks, then within each chunk a cut every 25k characters of any
    run of whitespace or non-whitespace (runs restart at each chunk)."""
    for chunk_start in range(0, len(text), MAX_CHUNK_CHARS):
        chunk = text[chunk_start : chunk_start + MAX_CHUNK_CHARS]
        cuts = [0]
        for run in _RUNS.finditer(chunk):
            cuts.extend(range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS))
        cuts.append(len(chunk))
        for start, end in itertools.pairwise(cuts):
            yield chunk[start:end]
