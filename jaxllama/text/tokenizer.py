"""The tokenizer interface, which each backend implements (`hf_tokenizer.py`, `sentencepiece_tokenizer.py`,
`tiktoken_tokenizer.py`); `loading.py` picks the backend for the files it finds.
"""

from __future__ import annotations

import abc
import functools
import re
from collections.abc import Iterable, Sequence

from jaxllama.text.incremental import IncrementalDecoder


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model.

    Attributes (set by each backend):
        vocab_size: number of ids, i.e. one more than the largest id (specials included).
        bos_id, eos_id: the tokenizer's own begin/end-of-text ids, or None.
        bos_token, eos_token: their text (what a chat template writes), or None.
        special_tokens: text -> id of every special/control token.
        add_bos: whether this model's tokenizer prepends BOS by default.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    bos_token: str | None
    eos_token: str | None
    special_tokens: dict[str, int]
    add_bos: bool

    def prepare(self) -> None:
        """Build now what encoding builds on its first call (a model's loader calls this on a thread); most backends
        build everything when they load."""
        return None

    def encode(self, text: str, *, add_bos: bool = False, allow_special: bool = True) -> list[int]:
        """Token ids of `text`, with exactly one BOS id in front if `add_bos` (never otherwise).

        allow_special: special-token text in `text` (e.g. "<|eot_id|>") becomes its id; with False it
        is encoded as plain text.
        """
        ids = self._encode(text, allow_special=allow_special)
        if not add_bos:
            return ids
        if self.bos_id is None:
            raise ValueError("add_bos=True, but this tokenizer has no BOS token")
        return [self.bos_id, *ids]

    def encode_with_specials(
        self, text: str, specials: Sequence[tuple[int, int]], *, add_bos: bool = False
    ) -> list[int]:
        """Token ids of `text` where the (start, end) spans `specials`, in order, are special tokens, and every
        other part is plain text, special-token text included (e.g. a chat message's content).

        The text between two special tokens is encoded as each backend encodes it with `allow_special`, so
        without special-token text elsewhere this is `encode(text, allow_special=True)`.
        """
        ids = self.encode("", add_bos=add_bos)
        end = 0
        for start, stop in [*specials, (len(text), len(text))]:
            if start > end:
                ids += self._encode_text(text[end:start], after_special=end > 0)
            if stop > start:
                ids.append(self.special_tokens[text[start:stop]])
            end = stop
        return ids

    def _encode_text(self, text: str, *, after_special: bool) -> list[int]:
        """Token ids of `text` as plain text, as it is encoded at the start of a text or after a special token."""
        return self._encode(text, allow_special=False)

    def special_spans(self, text: str) -> list[tuple[int, int]]:
        """The (start, end) spans of special-token text in `text` (which `encode` turns into special tokens by
        default): leftmost first, the longest at a place."""
        pattern = self._special_text_pattern
        return [] if pattern is None else [match.span() for match in pattern.finditer(text)]

    @functools.cached_property
    def _special_text_pattern(self) -> re.Pattern | None:
        by_length = sorted(filter(None, self.special_tokens), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, by_length))) if by_length else None

    @abc.abstractmethod
    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        """Token ids of `text`, adding nothing."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of `ids`; special tokens appear as their text unless `skip_special`.

        Bytes that do not form valid UTF-8 decode to U+FFFD.
        """

    def token_text(self, i: int) -> str:
        """`decode([i])`, remembered per id: log-probabilities name every token and its alternatives by their text,
        hundreds of thousands of times in a scoring job."""
        texts = self.__dict__.setdefault("_token_texts", {})
        text = texts.get(i)
        if text is None:
            text = texts[i] = self.decode([i])
        return text

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a special or ordinary token, spelled as in the vocabulary; None if unknown."""

    @abc.abstractmethod
    def id_to_token(self, i: int) -> str:
        """The vocabulary's spelling of token `i` (e.g. "Ġhello", "▁hello", "<|eot_id|>").

        Raises KeyError for an id outside the vocabulary.
        """

    def incremental_decoder(self, *, skip_special: bool = False) -> IncrementalDecoder:
        """A streaming decoder: push ids one at a time, get text pieces that join to `decode(ids)`."""
        return IncrementalDecoder(self, skip_special=skip_special)
