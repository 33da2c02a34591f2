"""A GGUF file's vocabulary as HF tokenizer files (tokenizer.json + tokenizer_config.json).

GGUF stores no tokenizer.json, only llama.cpp metadata. Two vocabulary kinds are rebuilt, with
llama.cpp's tokenization rules:

- "gpt2": byte-level BPE from tokens + merges; the pre-tokenizer split is chosen by tokenizer.ggml.pre.
- "llama": sentencepiece BPE from tokens + scores + token types. Merges are recovered from the
  scores (a pair may merge if the joined piece is in the vocabulary; higher score merges first),
  spaces become "▁", each text part gets a leading "▁" (add_space_prefix; after special tokens too,
  as llama.cpp does), characters missing from the vocabulary fall back to <0xXX> byte tokens.

Control (and unknown) tokens become special added tokens; user-defined tokens become added tokens
that are not special (llama.cpp always matches them whole, also when special text is not parsed).
"""

from __future__ import annotations

import json
from typing import Any

import gguf
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from jaxllama.text.byte_level import CHAR_TO_BYTE, spell
from jaxllama.text.sentencepiece_tokenizer import SPACE_SYMBOL
from jaxllama.text.tiktoken_tokenizer import SPLIT_PATTERN as LLAMA3_SPLIT

LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
GPT2_PRE = ("default", "gpt-2")
SMOLLM_PRE = ("smollm",)


def tokenizer_files_from_gguf(reader: gguf.GGUFReader) -> dict[str, str]:
    """{"tokenizer.json": text, "tokenizer_config.json": text} for the vocabulary in `reader`.

    tokenizer_config.json carries bos_token, eos_token, add_bos_token and, if the file has one,
    chat_template. Raises ValueError for a vocabulary kind or pre-tokenizer this does not know.
    """
    meta = _Metadata(reader)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        # A vocabulary of single bytes and specials needs no merges; writers then omit the empty list.
        tokenizer = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges", []), pre)
        default_add_bos = pre in LLAMA3_PRE
    elif kind == "llama":
        scores: list[float] = meta.get("tokenizer.ggml.scores")
        unk_id = meta.get("tokenizer.ggml.unknown_token_id", None)
        add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tokenizer = _sentencepiece_bpe(tokens, types, scores, unk_id, add_space_prefix)
        default_add_bos = True
    else:
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', 'llama')")

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}", None)
        config[name] = tokens[token_id] if token_id is not None else None
    config["add_bos_token"] = meta.get("tokenizer.ggml.add_bos_token", default_add_bos)
    chat_template = meta.get("tokenizer.chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template

    if config["add_bos_token"] and config["bos_token"] is not None:
        bos = config["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[bos, "$A"], pair=[bos, "$A", bos, "$B"], special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
    }


class _Metadata:
    """Values of a GGUF reader's fields."""

    _REQUIRED = object()

    def __init__(self, reader: gguf.GGUFReader):
        self._fields = reader.fields

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self._fields.get(key)
        if field is not None:
            return field.contents()
        if default is self._REQUIRED:
            raise ValueError(f"GGUF file has no {key}, needed to build its tokenizer")
        return default


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """Byte-level BPE (GPT-2 / Llama 3 / SmolLM style)."""
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError("GGUF tokenizer.ggml.merges has an entry that is not two tokens separated by a space")
    merged = {left + right for left, right in pairs}
    # llama.cpp stores control/user-defined tokens as raw text ("<|eot_id|>", or with real spaces),
    # normal tokens in the byte-level spelling. A raw token outside the alphabet is keyed by its raw
    # text (so it can be an added token), unless merges need its spelling: then it stays a plain token.
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for i, (token, token_type) in enumerate(zip(tokens, types, strict=True)):
        spelled = token if all(c in CHAR_TO_BYTE for c in token) else spell(token.encode("utf-8"))
        if token_type in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN) and (
            spelled == token or spelled not in merged
        ):
            vocab[token] = i
            added.append(_added_token(token, token_type))
        else:
            vocab[spelled] = i

    ignore_merges = pre in LLAMA3_PRE
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, added)
    return tokenizer


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """How text is split before BPE, by llama.cpp's tokenizer.ggml.pre name."""
    if pre in LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in SMOLLM_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    known = ", ".join(LLAMA3_PRE + SMOLLM_PRE + GPT2_PRE)
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {known})")


def _sentencepiece_bpe(
    tokens: list[str], types: list[int], scores: list[float], unk_id: int | None, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """Sentencepiece-style BPE with byte fallback, as llama.cpp tokenizes a "llama" vocabulary."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    model = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, types, scores),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=TokenType.BYTE in types,
    )
    tokenizer = tokenizers.Tokenizer(model)
    replace_spaces = normalizers.Replace(" ", SPACE_SYMBOL)
    to_text = [decoders.Replace(SPACE_SYMBOL, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_SYMBOL), replace_spaces])
        tokenizer.decoder = decoders.Sequence([*to_text, decoders.Strip(content=" ", left=1, right=0)])
    else:
        tokenizer.normalizer = replace_spaces
        tokenizer.decoder = decoders.Sequence(to_text)
    added = [
        _added_token(token, token_type)
        for token, token_type in zip(tokens, types, strict=True)
        if token_type in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
    ]
    _add_tokens(tokenizer, added)
    return tokenizer


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to sentencepiece's: every split of a normal piece into two normal pieces,
    ordered by the joined piece's score, best first (ties: lower piece id, shorter left part)."""
    normal = {
        token: i
        for i, (token, token_type) in enumerate(zip(tokens, types, strict=True))
        if token_type == TokenType.NORMAL
    }
    ranked = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _added_token(token: str, token_type: int) -> AddedToken:
    return AddedToken(token, special=token_type != TokenType.USER_DEFINED, normalized=False)


def _add_tokens(tokenizer: tokenizers.Tokenizer, added: list[AddedToken]) -> None:
    """Register added tokens (all already in the model vocabulary, so their ids stay)."""
    tokenizer.add_special_tokens([token for token in added if token.special])
    tokenizer.add_tokens([token for token in added if not token.special])
