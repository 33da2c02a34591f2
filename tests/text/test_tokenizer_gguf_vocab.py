"""tokenizer_files_from_gguf on byte-level ("gpt2") vocabularies written in the test, against tiktoken.

The vocabulary is the first ranks of Meta's Llama 3 tokenizer.model (a valid, smaller BPE), written as
llama.cpp does: tokens in byte-level spelling, merges, control tokens as raw text. tiktoken with the
same ranks and the split pattern the pre-tokenizer name stands for is the reference. This covers what
SmolLM2's file does not: the Llama 3 ("llama-bpe") and GPT-2 splits, control tokens whose raw text is
outside the byte-level alphabet, user-defined tokens, and unknown pre-tokenizer names.
"""

from __future__ import annotations

import base64
from pathlib import Path

import gguf
import llama_models
import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllama.text.byte_level import spell
from jaxllama.text.gguf_vocab import tokenizer_files_from_gguf
from jaxllama.text.hf_tokenizer import HFTokenizer
from jaxllama.text.loading import load_tokenizer
from jaxllama.text.tiktoken_tokenizer import SPLIT_PATTERN
from tests.helpers.text import assert_streams_like_decode

NUM_RANKS = 3000
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PATTERNS = {"llama-bpe": SPLIT_PATTERN, "gpt-2": GPT2_PATTERN, "default": GPT2_PATTERN}
# Appended after the ranks: (raw text, type). The second is how DeepSeek-style names look in GGUF.
EXTRA = [
    ("<|begin_of_text|>", gguf.TokenType.CONTROL),
    ("<｜end▁of▁sentence｜>", gguf.TokenType.CONTROL),
    ("<think>", gguf.TokenType.USER_DEFINED),
]
TEXTS = [
    "",
    "Hello world! The quick brown fox.",
    "  two spaces, then   three, trailing  ",
    "tabs\t\tand new\nlines\n\n\nCRLF\r\n",
    "digits 1 12 123 1234 12345 3.14159",
    "I'm sure you'll see it's HE'S and We'VE",
    "naïve café 東京 😀 👩‍👩‍👧‍👦",
    "def f(x):\n    return x ** 2  # sq\n",
    "<|begin_of_text|>Hello<think>world<｜end▁of▁sentence｜>",
]


def meta_ranks(count: int) -> dict[bytes, int]:
    lines = (Path(llama_models.__file__).parent / "llama3" / "tokenizer.model").read_text().splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines[:count])}


def merges_from_ranks(ranks: dict[bytes, int]) -> list[str]:
    """Every split of a token into two tokens, ordered by the joined token's rank (tiktoken's rule)."""
    ranked = sorted(
        (rank, cut, token)
        for token, rank in ranks.items()
        for cut in range(1, len(token))
        if token[:cut] in ranks and token[cut:] in ranks
    )
    return [f"{spell(token[:cut])} {spell(token[cut:])}" for _, cut, token in ranked]


def write_gguf(path: Path, *, pre: str, types: dict[int, gguf.TokenType] | None = None) -> Path:
    """The first NUM_RANKS Meta ranks plus EXTRA, as a GGUF vocabulary. `types`/raw text override by id."""
    ranks = meta_ranks(NUM_RANKS)
    tokens = [spell(token) for token in sorted(ranks, key=ranks.get)] + [text for text, _ in EXTRA]
    token_types = [gguf.TokenType.NORMAL] * NUM_RANKS + [token_type for _, token_type in EXTRA]
    for i, token_type in (types or {}).items():
        token_types[i] = token_type
        tokens[i] = bytes(ranks_by_id(ranks)[i]).decode("utf-8")  # llama.cpp stores these raw
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges_from_ranks(ranks))
    writer.add_bos_token_id(NUM_RANKS)
    writer.add_eos_token_id(NUM_RANKS + 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ranks_by_id(ranks: dict[bytes, int]) -> dict[int, bytes]:
    return {rank: token for token, rank in ranks.items()}


def reference_for(pre: str) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name=f"meta-{NUM_RANKS}-{pre}",
        pat_str=PATTERNS[pre],
        mergeable_ranks=meta_ranks(NUM_RANKS),
        special_tokens={text: NUM_RANKS + i for i, (text, _) in enumerate(EXTRA)},
    )


def reference_ids(reference: tiktoken.Encoding, text: str, *, allow_special: bool = True) -> list[int]:
    """User-defined tokens are matched whole even when special text is not parsed (as llama.cpp does)."""
    allowed = "all" if allow_special else {"<think>"}
    return reference.encode(text, allowed_special=allowed, disallowed_special=())


@pytest.fixture(scope="module", params=["llama-bpe", "gpt-2", "default"])
def case(request, tmp_path_factory) -> tuple[HFTokenizer, tiktoken.Encoding]:
    pre = request.param
    tokenizer = load_tokenizer(write_gguf(tmp_path_factory.mktemp(pre) / "vocab.gguf", pre=pre))
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer, reference_for(pre)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("allow_special", [True, False])
def test_ids_equal_tiktoken(case, text, allow_special):
    tokenizer, reference = case
    ids = tokenizer.encode(text, allow_special=allow_special)
    assert ids == reference_ids(reference, text, allow_special=allow_special)
    assert tokenizer.decode(ids) == reference.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=50))
def test_random_text_equals_tiktoken(case, text):
    tokenizer, reference = case
    ids = tokenizer.encode(text)
    assert ids == reference_ids(reference, text)
    assert tokenizer.decode(ids) == text
    assert_streams_like_decode(tokenizer, ids)


def test_attributes(case):
    tokenizer, _ = case
    begin, end, think = NUM_RANKS, NUM_RANKS + 1, NUM_RANKS + 2
    assert (tokenizer.bos_token, tokenizer.bos_id) == ("<|begin_of_text|>", begin)
    assert (tokenizer.eos_token, tokenizer.eos_id) == ("<｜end▁of▁sentence｜>", end)
    assert tokenizer.special_tokens == {"<|begin_of_text|>": begin, "<｜end▁of▁sentence｜>": end}
    assert tokenizer.token_to_id("<think>") == think
    assert tokenizer.vocab_size == NUM_RANKS + len(EXTRA)
    text = "<|begin_of_text|>Hello<think>world<｜end▁of▁sentence｜>"
    assert tokenizer.decode(tokenizer.encode(text), skip_special=True) == "Hello<think>world"


def test_add_bos_default_follows_llama_cpp(case):
    """Without tokenizer.ggml.add_bos_token, llama.cpp adds BOS for Llama 3 vocabularies only."""
    tokenizer, reference = case
    assert tokenizer.add_bos is (reference.name.endswith("llama-bpe"))


def test_raw_token_whose_spelling_merges_produce(tmp_path):
    """A vocabulary token marked user-defined and stored raw ("  ") while merges produce its byte-level
    spelling ("ĠĠ") stays an ordinary entry, so BPE still reaches it."""
    ranks = meta_ranks(NUM_RANKS)
    double_space = ranks[b"  "]
    path = write_gguf(tmp_path / "vocab.gguf", pre="llama-bpe", types={double_space: gguf.TokenType.USER_DEFINED})
    tokenizer = HFTokenizer(tokenizer_files_from_gguf(gguf.GGUFReader(path)))
    reference = reference_for("llama-bpe")
    for text in ["a  b", "  x", "x    y  "]:
        assert tokenizer.encode(text) == reference_ids(reference, text)
    assert tokenizer.decode([double_space]) == "  "


@pytest.mark.slow
def test_unknown_pre_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "vocab.gguf", pre="qwen2")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'qwen2' is not supported"):
        load_tokenizer(path)
