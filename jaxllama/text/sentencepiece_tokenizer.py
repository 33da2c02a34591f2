"""Backend for sentencepiece models (tokenizer.model protobuf: Llama 1/2, Mistral, ...).

Special tokens are the model's control and unknown pieces (e.g. <s>, </s>, <unk>). sentencepiece
itself reads them as plain text; here, with allow_special, the text between them is encoded piece by
piece, each part getting sentencepiece's dummy-prefix space (as llama.cpp and Meta's chat code do).
Decoding keeps the space of a text part that follows a special token ("<s> hello"), like HF's and
llama.cpp's Llama decoders; only the very first space of the whole text is dropped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import sentencepiece

from jaxllama.text.tokenizer import Tokenizer

SPACE_SYMBOL = "▁"


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model. BOS is added by default when the model has one (Llama convention)."""

    def __init__(self, model_file: str | os.PathLike):
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=Path(model_file).read_bytes())
        sp = self._sp
        self.vocab_size = sp.get_piece_size()
        self.special_tokens = {
            sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)
        }
        self._special_ids = frozenset(self.special_tokens.values())
        by_length = sorted(self.special_tokens, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        self.bos_token = sp.id_to_piece(self.bos_id) if self.bos_id is not None else None
        self.eos_token = sp.id_to_piece(self.eos_id) if self.eos_id is not None else None
        self.add_bos = self.bos_id is not None
        self._drops_first_space = _drops_first_space(sp)

    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        if not allow_special or self._special_pattern is None:
            return self._sp.encode(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > start:
                ids += self._sp.encode(text[start : match.start()])
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._sp.encode(text[start:])
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            return self._sp.decode([i for i in ids if i not in self._special_ids])
        parts: list[str] = []
        run: list[int] = []  # consecutive non-special ids
        for i in [*ids, None]:
            if i is not None and i not in self._special_ids:
                run.append(i)
                continue
            if run:
                parts.append(self._decode_run(run, at_start=not parts))
                run = []
            if i is not None:
                parts.append(self._sp.id_to_piece(i))
        return "".join(parts)

    def _decode_run(self, run: list[int], *, at_start: bool) -> str:
        """sentencepiece's text of `run`; it drops a leading "▁" as the dummy prefix, which a run
        after a special token keeps."""
        text = self._sp.decode(run)
        if not at_start and self._drops_first_space and self._sp.id_to_piece(run[0]).startswith(SPACE_SYMBOL):
            return " " + text
        return text

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None

    def id_to_token(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise KeyError(f"token id {i} is not in the vocabulary")
        return self._sp.id_to_piece(i)


def _drops_first_space(sp: sentencepiece.SentencePieceProcessor) -> bool:
    """Whether decoding drops the "▁" a text starts with (models with a dummy prefix do)."""
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or not piece.startswith(SPACE_SYMBOL):
            continue
        if piece == SPACE_SYMBOL or piece[1] != SPACE_SYMBOL:
            return not sp.decode([i]).startswith(" ")
    return False
