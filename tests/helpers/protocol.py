"""A stand-in for a model's text side in the request pipeline's tests: one token per character."""

from __future__ import annotations


class Characters:
    """An encoder of one token per character; a conversation is its contents, each after its role's initial."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(m["role"][0] + m["content"] for m in messages))

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))
