"""`PromptEncoder`: a model's text side as a request needs it, built from the text layer's pieces (its tokenizer,
chat template and grammar compiler): a prompt or a conversation to token ids, an output format to the grammar its
text must match, token ids back to text. What the request pipeline (`jaxllama.protocol.pipeline`) is given, and
what `jaxllama.LLM`'s methods of the same names run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxllama.errors import InvalidParameter, is_int
from jaxllama.text.chat_template import ChatTemplate, encode_chat
from jaxllama.text.conversation import validate_messages
from jaxllama.text.structured import Grammar, GrammarCompiler, OutputFormat
from jaxllama.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class PromptEncoder:
    tokenizer: Tokenizer
    template: ChatTemplate
    grammars: GrammarCompiler
    vocab_size: int  # the model's: ids past the tokenizer's own may still be the model's

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """The prompt token ids of a plain text prompt: BOS in front if the model's tokenizer adds one (or as
        `add_bos` says); special-token text in `text` stays plain text."""
        add_bos = self.tokenizer.add_bos if add_bos is None else add_bos
        return self.tokenizer.encode(text, add_bos=add_bos, allow_special=False)

    def encode_chat(self, messages, **kwargs) -> list[int]:
        """The prompt token ids of a conversation: the chat template applied (with the generation prompt), then
        tokenized."""
        return encode_chat(self.tokenizer, self.template, validate_messages(messages), **kwargs)

    def grammar(self, output: OutputFormat, stop_token_ids: Sequence[int] = ()) -> Grammar:
        """The grammar a request's text must match (structured output), ended by the model's end-of-generation ids
        and the request's own `stop_token_ids`; InvalidParameter for a schema, regular expression or grammar that
        cannot be compiled."""
        return self.grammars.compile(output, tuple(stop_token_ids))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (special tokens included); InvalidParameter for an id outside the vocabulary."""
        for j, v in enumerate(ids):
            if not (is_int(v) and 0 <= v < self.vocab_size):
                message = f"tokens[{j}] = {v!r}: not a token id (expected 0 <= id < vocab_size = {self.vocab_size})"
                raise InvalidParameter(message, "tokens")
        return self.tokenizer.decode(list(ids))
