"""Structured output: what a request's text must match (a JSON schema, any JSON object, a regular expression or a
Lark grammar), compiled with llguidance into a matcher that gives, before each token, the bitmask of the tokens that
keep the text matching, and is told each token drawn (`jaxllama.engine.request.TokenConstraint`).

The matcher works on the model's own token ids: llguidance reads the HF `tokenizers` JSON (GGUF vocabularies are
rebuilt as one) or tiktoken's ranks (Meta's Llama 3 tokenizer.model); a sentencepiece tokenizer.model is refused.
An end-of-generation id is allowed only where the text may end, so the grammar decides when a row stops.

A grammar can pass llguidance's checks and still reach its limits while it is followed (a regular expression that
builds too many lexer states, a recursive schema, a grammar whose parse grows past its item limit): the matcher then
allows nothing but an end-of-generation id, and its text does not match. What shows at the first token is refused
when the grammar is compiled; what shows later is the matcher's `error`, which ends the request as an error (never
as "stop"), naming the request field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable

import numpy as np

from jaxllama.errors import InvalidParameter
from jaxllama.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class OutputFormat:
    """What the text must match: `kind` "json_object", "json_schema", "regex" or "grammar"; `value` the JSON schema
    (a dict), the regular expression or the Lark grammar (None for json_object); `param` the request field that
    asked for it (for error messages)."""

    kind: str
    value: object = None
    param: str = "response_format"


class GrammarCompiler:
    """Compiles `OutputFormat`s for one model: its tokenizer, the width of its logits (`vocab_size`, which may exceed
    the tokenizer's) and its end-of-generation ids. The llguidance tokenizer is built on first use (~0.5 s)."""

    CACHED = 256  # compiled grammars kept (a job asks for a few schemas many times)

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(set(eos_ids))
        self._compiled: dict[tuple, Grammar] = {}

    @functools.cached_property
    def _lltokenizer(self):
        import llguidance

        from jaxllama.text.hf_tokenizer import HFTokenizer
        from jaxllama.text.tiktoken_tokenizer import Llama3Tokenizer

        eos = self.eos_ids or ([self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else [])
        if not eos:
            raise InvalidParameter("structured output needs an end-of-generation token, and this model has none")
        if isinstance(self.tokenizer, HFTokenizer):
            return llguidance.LLTokenizer(self.tokenizer.tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        if isinstance(self.tokenizer, Llama3Tokenizer):
            from llguidance.tiktoken import lltokenizer_from_encoding

            return lltokenizer_from_encoding(self.tokenizer.encoding, n_vocab=self.vocab_size, eos_token=eos)
        raise InvalidParameter(
            f"structured output is not available with this model's {type(self.tokenizer).__name__}: it needs a "
            "tokenizer.json (HF tokenizers, or a GGUF vocabulary) or Meta's Llama 3 tiktoken tokenizer.model"
        )

    def compile(self, output: OutputFormat, stop_ids: Iterable[int] = ()) -> Grammar:
        """The grammar of `output`; raises InvalidParameter (naming `output.param`) when llguidance refuses it.
        `stop_ids`: the request's own extra end-of-generation ids, allowed wherever the model's are."""
        key = (output.kind, json.dumps(output.value, sort_keys=True), tuple(sorted(set(stop_ids))))
        if key not in self._compiled:
            if len(self._compiled) >= self.CACHED:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = self._compile(output, key[2])
        return self._compiled[key]

    def _compile(self, output: OutputFormat, stop_ids: tuple[int, ...]) -> Grammar:
        import llguidance

        if output.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        elif output.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(output.value)
        elif output.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(output.value)
        elif output.kind == "grammar":
            grammar = llguidance.LLMatcher.grammar_from_lark(output.value)
        else:
            raise ValueError(f"unknown output kind {output.kind!r}")
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._lltokenizer)
        if error:
            raise InvalidParameter(f"{output.param}: {messages[0]}", output.param)
        compiled = Grammar(self._lltokenizer, grammar, tuple(sorted(set(stop_ids) - set(self.eos_ids))), output.param)
        first = compiled.matcher()  # what fails at once (a schema that refers to itself: {"$ref": "#"}) is refused now
        first.fill_mask(np.zeros((self.vocab_size + 31) // 32, np.int32))
        if first.error is not None:
            raise first.error
        return compiled


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A compiled grammar; `matcher()` gives a fresh matcher for one output (a request's, or one of its n)."""

    lltokenizer: object
    grammar: str
    extra_stops: tuple[int, ...] = ()
    param: str = "response_format"  # the request field that asked for it, named by the matcher's errors

    def matcher(self) -> Matcher:
        return Matcher(self)


class Matcher:
    """One output's progress through its grammar: keeps `TokenConstraint`."""

    def __init__(self, grammar: Grammar):
        import llguidance

        self._matcher = llguidance.LLMatcher(grammar.lltokenizer, grammar.grammar, log_level=0)
        self._param, self._accepted = grammar.param, 0
        self._eos = np.array(grammar.lltokenizer.eos_tokens, np.int64)
        self._extra = np.array(grammar.extra_stops, np.int64)

    def fill_mask(self, out: np.ndarray) -> None:
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)
        if len(self._extra) and _allowed(out, self._eos).any():  # the request's own stop ids end it where eos may
            words, bits = self._extra // 32, self._extra % 32
            np.bitwise_or.at(out.view(np.uint32), words, (np.uint32(1) << bits.astype(np.uint32)))

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._accepted += 1

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> InvalidParameter | None:
        """Why the grammar cannot be followed further (llguidance's limits reached), or None."""
        if not self._matcher.is_error():
            return None
        reason = (self._matcher.get_error().splitlines() or ["unknown error"])[0]
        n = self._accepted
        where = f"after {n} token{'s' * (n != 1)}" if n else "at the first token"
        return InvalidParameter(f"{self._param}: the grammar cannot be followed {where} ({reason})", self._param)


def _allowed(mask: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return (mask.view(np.uint32)[tokens // 32] >> (tokens % 32).astype(np.uint32)) & 1 == 1


def parse_json_schema(value, param: str) -> dict:
    """A JSON schema given as an object (or its JSON text), as a dict; raises InvalidParameter."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidParameter(f"{param}: not valid JSON ({e})", param) from None
    if not isinstance(value, dict):
        raise InvalidParameter(f"{param}: must be a JSON schema (an object)", param)
    return value
