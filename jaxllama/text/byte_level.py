"""GPT-2's byte-level alphabet: each of the 256 byte values spelled as one printable character.

Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM) store tokens in this spelling, e.g. the bytes
b" hello" are the token text "Ġhello". Printable ASCII other than space spells itself.
"""

from __future__ import annotations


def _byte_to_char() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    unprintable = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(unprintable)})
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def spell(data: bytes) -> str:
    """The byte-level spelling of `data`, one character per byte."""
    return "".join(BYTE_TO_CHAR[b] for b in data)


def unspell(text: str) -> bytes | None:
    """The bytes `text` spells, or None if a character is outside the alphabet."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        return None
