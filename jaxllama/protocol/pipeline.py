"""One path from an OpenAI request body to what the engine runs, for `jaxllama run` and `jaxllama serve` alike:
body -> checked fields (`requests.parse_body`) -> prompt token ids (the model's tokenizer and chat template) -> a
`PreparedRequest`, which the caller submits to the engine.

Each step raises a `jaxllama.errors` class when the request is bad; the caller answers it through
`jaxllama.protocol.errors`, the same way whichever front end read the body.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxllama.engine.request import SamplingParams
from jaxllama.errors import InvalidParameter, InvalidRequest
from jaxllama.protocol.requests import OutputOptions, parse_body
from jaxllama.text.structured import Grammar, OutputFormat
from jaxllama.text_engine import TextRequest


class Encoder(Protocol):
    """Text to prompt token ids, and an output format to its grammar: what `jaxllama.text.prompts.PromptEncoder`
    provides (`LLM.prompts`)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict]) -> list[int]: ...

    def grammar(self, output: OutputFormat, stop_token_ids: tuple[int, ...]) -> Grammar: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A valid request, ready for the engine: one prompt, or a completion's several (an answer each)."""

    kind: str  # "chat" | "completion"
    prompts: list[list[int]]  # token ids
    params: SamplingParams
    stop: list[str]
    options: OutputOptions
    model: str | None = None  # the body's "model", if it is a string
    grammar: Grammar | None = None  # what the text must match (structured output)
    n: int = 1  # samples of the prompt
    texts: list[str] | None = None  # a completion's prompts as text (what `echo` answers)

    @property
    def prompt(self) -> list[int]:
        """The prompt of a request of one."""
        return self.prompts[0]

    def text_requests(self, priority: int = 0) -> list[TextRequest]:
        """What the engine runs for it: a request per prompt, each of `n` samples."""
        logprobs = self.options.logprobs
        return [
            TextRequest(p, self.params, self.stop, False, logprobs, priority, self.grammar, self.n)
            for p in self.prompts
        ]


@dataclasses.dataclass(frozen=True)
class RequestPipeline:
    """What a front end fixes for all its requests: the encoder, the sampling defaults and stop strings a body's
    fields override, a system prompt for conversations without one, and whether the answer can be delivered as the
    delivery fields ask: the server can stream and answer several prompts at once; job lines are answered whole, a
    record each, so their stream fields are ignored and a line of several prompts is refused."""

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
        options = parsed.options
        if not self.output_options:
            if kind == "completion" and len(parsed.prompts) > 1:
                raise InvalidRequest("prompt: a job line holds one prompt", "prompt")
            options = dataclasses.replace(options, stream=False, include_usage=False)
        elif options.stream and kind == "completion" and len(parsed.prompts) > 1:
            raise InvalidParameter("stream: only with a single prompt", "stream")
        if kind == "chat":
            prompts = [self.encoder.encode_chat(with_system_prompt(parsed.messages, self.system_prompt))]
            texts = None
        else:
            prompts = [p if isinstance(p, list) else self.encoder.encode(p) for p in parsed.prompts]
            texts = (
                [p if isinstance(p, str) else self.encoder.decode(p) for p in parsed.prompts] if options.echo else None
            )
        grammar = self.encoder.grammar(parsed.output, parsed.params.stop_token_ids) if parsed.output else None
        return PreparedRequest(
            kind, prompts, parsed.params, parsed.stop, options, parsed.model, grammar, parsed.n, texts
        )


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """The conversation with `system_prompt` as its first message, unless it starts with a system message."""
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages
