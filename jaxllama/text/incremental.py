"""Streaming detokenization that agrees exactly with a tokenizer's whole-sequence `decode`.

Generic over backends: it only calls `tokenizer.decode` on a short window of recent ids. The window
starts with a few already-emitted "context" ids, so rules that depend on neighbours (sentencepiece
dropping the space of the first piece, bytes that only form a character together) come out as in
a decode of the whole sequence. Text is held back while it may still change:
- a trailing U+FFFD run (at most 3 characters: an incomplete UTF-8 character is at most 3 bytes);
- the text of a trailing run of byte-fallback tokens ("<0xE2>"...): HF's ByteFallback decoder turns
  a whole run into U+FFFD if any byte of it is invalid, so a run is settled only when it ends (a
  skipped special token does not end it: it is removed before decoding).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxllama.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
_MAX_PENDING_CHARS = 3
# Once the window holds this many ids (and nothing is held back) it is cut down to a short context.
_WINDOW_LIMIT = 16
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDecoder:
    """Turns token ids, pushed one at a time, into text.

    Invariant: "".join(push(i) for i in ids) + flush() == tokenizer.decode(ids, skip_special=...).
    No piece ends inside a UTF-8 character. Each push decodes at most ~`_WINDOW_LIMIT` ids, except
    while text is held back or the ids carry no text (e.g. skipped specials): then the window keeps
    growing until text settles.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._decode = functools.partial(tokenizer.decode, skip_special=skip_special)
        self._id_to_token = tokenizer.id_to_token
        self._skipped_ids = frozenset(tokenizer.special_tokens.values()) if skip_special else frozenset()
        self._window: list[int] = []
        self._context_text = ""  # decode of the window's context ids (already emitted earlier)
        self._emitted = 0  # characters after the context text already returned
        self._byte_run_start: int | None = None  # window index where a trailing byte-token run starts

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (often "", e.g. for part of a character)."""
        token_id = int(token_id)
        if token_id in self._skipped_ids:
            pass
        elif not _BYTE_TOKEN.fullmatch(self._id_to_token(token_id)):
            self._byte_run_start = None
        elif self._byte_run_start is None:
            self._byte_run_start = len(self._window)
        self._window.append(token_id)

        text = self._decode(self._window)
        if self._byte_run_start is None:
            stable = text[len(self._context_text) :]
        else:
            stable = self._decode(self._window[: self._byte_run_start])[len(self._context_text) :]
        settled = len(stable) - _pending_length(stable)
        piece = stable[self._emitted : settled]
        self._emitted = max(self._emitted, settled)
        if len(text) == len(self._context_text) + self._emitted and len(self._window) >= _WINDOW_LIMIT:
            self._shrink_window(text)
        return piece

    def flush(self) -> str:
        """Return whatever is held back (e.g. U+FFFD of bytes that never formed a character)."""
        new_text = self._decode(self._window)[len(self._context_text) :]
        piece = new_text[self._emitted :]
        self._emitted = len(new_text)
        return piece

    def _shrink_window(self, text: str) -> None:
        """Keep the fewest trailing ids whose own decode is non-empty and ends `text` (all emitted).

        A context that decodes differently on its own (it starts inside a character, or is only
        skipped specials) is passed over, since it could change how the ids after it decode.
        """
        for size in range(1, len(self._window)):
            context = self._window[-size:]
            context_text = self._decode(context)
            if context_text and text.endswith(context_text):
                self._window = context
                self._context_text = context_text
                self._emitted = 0
                return


def _pending_length(text: str) -> int:
    """How many trailing characters might still change: the last U+FFFD run, at most 3 long."""
    stripped = text.rstrip(REPLACEMENT_CHAR)
    return min(len(text) - len(stripped), _MAX_PENDING_CHARS)
