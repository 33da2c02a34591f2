"""One path from an OpenAI request body to what the engine runs, for `jaxllama run` and `jaxllama serve` alike:
body -> checked fields (`requests.parse_body`, `requests.output_options`) -> prompt token ids (the model's
tokenizer and chat template) -> a `PreparedRequest`, which the caller submits to the engine.

Each step raises a `jaxllama.errors` class when the request is bad; the caller answers it through
`jaxllama.protocol.errors`, the same way whichever front end read the body.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxllama.engine.request import SamplingParams
from jaxllama.errors import InvalidParameter
from jaxllama.protocol.requests import OutputOptions, output_options, parse_body
from jaxllama.text.structured import Grammar, OutputFormat


class Encoder(Protocol):
    """Text to prompt token ids, and an output format to its grammar: what `jaxllama.LLM` provides."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict]) -> list[int]: ...

    def grammar(self, output: OutputFormat, params: SamplingParams) -> Grammar: ...


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A valid request, ready for the engine."""

    kind: str  # "chat" | "completion"
    prompt: list[int]  # token ids
    params: SamplingParams
    stop: list[str]
    options: OutputOptions
    model: str | None = None  # the body's "model", if it is a string
    grammar: Grammar | None = None  # what the text must match (structured output)
    n: int = 1  # samples of the prompt


@dataclasses.dataclass(frozen=True)
class RequestPipeline:
    """What a front end fixes for all its requests: the encoder, the sampling defaults and stop strings a body's
    fields override, a system prompt for conversations without one, and whether the answer can be delivered as the
    delivery fields ask ("stream", "logprobs"): the server can; job lines are answered whole in records without
    log-probabilities, so a job line asking for them is refused rather than answered without them."""

    encoder: Encoder
    defaults: SamplingParams
    stop: tuple[str, ...] = ()
    system_prompt: str | None = None
    output_options: bool = True

    def prepare(self, body: dict, kind: str) -> PreparedRequest:
        """Check `body` (a "chat" or "completion" request) and encode its prompt. Raises a RequestError: the
        body's fields are bad (InvalidRequest, InvalidParameter, InvalidMessages) or the chat template failed on
        its conversation (TemplateError)."""
        parsed = parse_body(body, kind, self.defaults, list(self.stop))
        options = output_options(body, kind)
        if not self.output_options:
            if options.logprobs:
                field = "logprobs" if "logprobs" in body else "top_logprobs"
                raise InvalidParameter(f"{field}: job records do not carry log-probabilities", field)
            options = OutputOptions()
        if kind == "chat":
            prompt = self.encoder.encode_chat(with_system_prompt(parsed.messages, self.system_prompt))
        else:
            prompt = self.encoder.encode(parsed.prompt)
        grammar = self.encoder.grammar(parsed.output, parsed.params) if parsed.output else None
        return PreparedRequest(kind, prompt, parsed.params, parsed.stop, options, parsed.model, grammar, parsed.n)


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """The conversation with `system_prompt` as its first message, unless it starts with a system message."""
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages
