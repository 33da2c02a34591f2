"""Backend for HF `tokenizers` files: tokenizer.json plus tokenizer_config.json.

BOS/EOS text and whether BOS is added come from tokenizer_config.json (`bos_token`, `eos_token`,
`add_bos_token`), then special_tokens_map.json, then the post-processor's template in tokenizer.json.
The post-processor itself is never run: `encode` adds BOS only when asked.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

from jaxllama.text.tokenizer import Tokenizer

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class HFTokenizer(Tokenizer):
    """A tokenizer.json tokenizer.

    Args:
        files: file name -> text, with "tokenizer.json" and optionally "tokenizer_config.json" and
            "special_tokens_map.json" (the shape `tokenizer_files_from_gguf` returns).
    """

    def __init__(self, files: dict[str, str]):
        self._json = files["tokenizer.json"]
        self._tokenizer = tokenizers.Tokenizer.from_str(self._json)
        added = self._tokenizer.get_added_tokens_decoder()
        self.special_tokens = {token.content: i for i, token in sorted(added.items()) if token.special}
        # Special tokens are found in the raw text (none normalized first): a text without their text is encoded as
        # plain text by the tokenizer itself, and the copy that reads them as text is built only for one with it.
        self._specials_in_raw_text = not any(token.normalized for token in added.values() if token.special)
        self._prepends_at_start = _prepend_never(_component(self._tokenizer.pre_tokenizer))
        self.vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1

        config = _merged_config(files)
        template_bos, template_eos = self._template_bos_eos()
        self.bos_token = _token_text(config.get("bos_token")) or template_bos
        self.eos_token = _token_text(config.get("eos_token")) or template_eos
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token is not None else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token is not None else None
        add_bos = config.get("add_bos_token")
        self.add_bos = bool(add_bos) if add_bos is not None else template_bos is not None

    def prepare(self) -> None:
        """Build the copy chat messages are encoded with, where they need one (~0.2 s for a 49k vocabulary)."""
        if self._prepends_at_start:
            self._text_after_special  # noqa: B018 - a cached property, built on first access

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer.json text this tokenizer was built from."""
        return self._json

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> HFTokenizer:
        """Load tokenizer.json and whichever config files exist in `folder`."""
        folder = Path(folder)
        names = ("tokenizer.json", *CONFIG_FILES)
        return cls({name: (folder / name).read_text(encoding="utf-8") for name in names if (folder / name).is_file()})

    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        tokenizer = self._tokenizer if allow_special else self._plain_text_tokenizer(text, after_special=False)
        return _encode_releasing_the_gil(tokenizer, text)

    def _encode_text(self, text: str, *, after_special: bool) -> list[int]:
        return _encode_releasing_the_gil(self._plain_text_tokenizer(text, after_special=after_special), text)

    def _plain_text_tokenizer(self, text: str, *, after_special: bool) -> tokenizers.Tokenizer:
        """What encodes `text` as plain text, as at the start of a text or after a special token: the tokenizer
        itself unless `text` holds special-token text (or its pre-tokenizer treats text after a special token
        otherwise)."""
        if after_special and self._prepends_at_start:
            return self._text_after_special
        pattern = self._special_text_pattern
        if self._specials_in_raw_text and (pattern is None or pattern.search(text) is None):
            return self._tokenizer
        return self._special_as_text

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        token = self._tokenizer.id_to_token(i)
        if token is None:
            raise KeyError(f"token id {i} is not in the vocabulary")
        return token

    @functools.cached_property
    def _special_as_text(self) -> tokenizers.Tokenizer:
        """A copy that encodes special-token text as ordinary text."""
        tokenizer = tokenizers.Tokenizer.from_str(self._json)
        tokenizer.encode_special_tokens = True
        return tokenizer

    @functools.cached_property
    def _text_after_special(self) -> tokenizers.Tokenizer:
        """A copy that encodes special-token text as ordinary text, and encodes text as it does after a special
        token: a Metaspace pre-tokenizer that prepends "▁" only at the start of the text ("first") prepends none
        (byte-level tokenizers, as Llama 3's and SmolLM2's, have no such step: they need no such copy)."""
        config = json.loads(self._json)
        _prepend_never(config.get("pre_tokenizer"))
        tokenizer = tokenizers.Tokenizer.from_str(json.dumps(config))
        tokenizer.encode_special_tokens = True
        return tokenizer

    def _template_bos_eos(self) -> tuple[str | None, str | None]:
        """The special tokens the post-processor's single-sequence template puts first / last."""
        template = _find_template(_component(self._tokenizer.post_processor))
        if template is None:
            return None, None
        single = template["single"]
        first = single[0].get("SpecialToken", {}).get("id") if single else None
        last = single[-1].get("SpecialToken", {}).get("id") if single else None
        return first, last


def _encode_releasing_the_gil(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text)`'s ids. `encode` holds the GIL while it works (seconds for megabytes of text, during
    which no other Python thread runs: a server tokenizing on a worker thread would still stall its event loop);
    `encode_batch` releases it, and gives the same ids."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def _merged_config(files: dict[str, str]) -> dict[str, Any]:
    """tokenizer_config.json entries over special_tokens_map.json entries."""
    config: dict[str, Any] = {}
    for name in reversed(CONFIG_FILES):
        if name in files:
            config.update({k: v for k, v in json.loads(files[name]).items() if v is not None})
    return config


def _token_text(value: str | dict | None) -> str | None:
    """A token given as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _component(part) -> dict | None:
    """The config of one part of a tokenizer (its pre-tokenizer, post-processor, ...), as tokenizer.json has it: read
    from the part alone, not by parsing the whole file again (megabytes, for a vocabulary's merges)."""
    return None if part is None else json.loads(part.__getstate__())


def _prepend_never(pre_tokenizer: dict | None) -> bool:
    """Turn Metaspace's prepend_scheme "first" into "never", in a pre-tokenizer config or a Sequence of them.
    Returns whether there was one."""
    if pre_tokenizer is None:
        return False
    changed = pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first"
    if changed:
        pre_tokenizer["prepend_scheme"] = "never"
    for inner in pre_tokenizer.get("pretokenizers", []):
        changed = _prepend_never(inner) or changed
    return changed


def _find_template(processor: dict | None) -> dict | None:
    """The TemplateProcessing entry of a post-processor, possibly nested in a Sequence."""
    if processor is None:
        return None
    if processor.get("type") == "TemplateProcessing":
        return processor
    for inner in processor.get("processors", []):
        found = _find_template(inner)
        if found is not None:
            return found
    return None
