"""Reading an OpenAI-style request body (chat or completion) into what the engine runs.

One place decides which request fields exist and what they may hold: the batch runner (each line of a job)
and the server (each HTTP request) both call `parse_body`. A bad body raises `RequestError` naming the field,
with an OpenAI-style error code, never a generic exception.
"""

from __future__ import annotations

import dataclasses

from jaxllama.engine.request import SamplingParams
from jaxllama.text.chat_template import ChatTemplateError
from jaxllama.text.conversation import ConversationError, validate_messages

# Request field -> SamplingParams field.
PARAMETERS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop_token_ids": "stop_token_ids",
}

# OpenAI fields that would change the answer and are not implemented: each with the value that means "off".
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "tools": None,
    "functions": None,
}


@dataclasses.dataclass
class RequestError(ValueError):
    """A request that cannot run: an OpenAI error `code`, a `message` for people, and the request field
    (`param`) at fault when there is one."""

    code: str
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass
class ParsedBody:
    """A valid request: the conversation (chat) or the prompt (completion), how to sample, the stop strings."""

    kind: str  # "chat" | "completion"
    messages: list[dict] | None
    prompt: str | None
    params: SamplingParams
    stop: list[str]
    model: str | None = None


def parse_body(body: dict, kind: str, defaults: SamplingParams, default_stop: list[str] = ()) -> ParsedBody:
    """Check a chat ("messages") or completion ("prompt") body; fields absent or null take `defaults` and
    `default_stop`. Unknown fields are ignored; fields of `UNSUPPORTED` other than their "off" value are
    refused. Raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("invalid_request", f"the request body must be a JSON object, got {type(body).__name__}")
    for key, off in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != off and not (off is None and not value):
            allowed = f"only {key}={off!r} is supported" if off is not None else "it is not supported"
            raise RequestError("invalid_parameter", f"{key}: {allowed}", key)
    messages = prompt = None
    if kind == "chat":
        try:
            messages = validate_messages(body.get("messages"))
        except ConversationError as e:
            raise RequestError("invalid_messages", str(e), "messages") from None
    elif kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str):
            got = type(prompt).__name__
            raise RequestError("invalid_request", f"prompt: must be a string (one per request), got {got}", "prompt")
    else:
        raise ValueError(f"kind must be 'chat' or 'completion', not {kind!r}")
    params = sampling_params(body, defaults)
    stop = stop_strings(body, default_stop)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return ParsedBody(kind, messages, prompt, params, stop, model)


def sampling_params(body: dict, defaults: SamplingParams) -> SamplingParams:
    """`defaults` with the body's sampling fields (see `PARAMETERS`); raises RequestError."""
    overrides = {}
    for key, field in PARAMETERS.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool):
            raise RequestError("invalid_parameter", f"{key}: must be a number, got {value!r}", key)
        if field == "stop_token_ids":
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise RequestError("invalid_parameter", f"{key}: must be a list of integers", key)
            value = tuple(value)
        overrides[field] = value
    try:
        return dataclasses.replace(defaults, **overrides)
    except (ValueError, TypeError) as e:
        message = str(e)  # "max_tokens=0: must be a positive integer"
        field = message.split("=")[0]
        named = [k for k, f in PARAMETERS.items() if f == field and body.get(k) is not None]
        param = named[-1] if named else field  # the last one given is the one applied
        if param != field:  # named as the request named it
            message = f"{param}={body[param]!r}: {message.split(': ', 1)[-1]}"
        raise RequestError("invalid_parameter", message, param) from None


def stop_strings(body: dict, default_stop: list[str] = ()) -> list[str]:
    """The body's "stop" (a string or a list of strings) as a list; raises RequestError."""
    stop = body.get("stop", list(default_stop))
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("invalid_parameter", "stop: must be a non-empty string or a list of them", "stop")
    return stop


@dataclasses.dataclass
class OutputOptions:
    """How the answer is delivered: streamed (with a usage chunk at the end), with log-probabilities."""

    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def output_options(body: dict, kind: str) -> OutputOptions:
    """The body's "stream", "stream_options" and log-probability fields; raises RequestError. Only the sampled
    tokens' log-probabilities are computed: asking for alternatives (chat "top_logprobs" > 0, completion
    "logprobs" > 0) is refused."""
    stream = _flag(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("invalid_parameter", "stream_options: must be an object", "stream_options")
        if not stream:
            raise RequestError("invalid_parameter", "stream_options: only allowed with stream=true", "stream_options")
        include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    if kind == "chat":
        logprobs = _flag(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or top < 0:
                raise RequestError("invalid_parameter", "top_logprobs: must be an integer >= 0", "top_logprobs")
            if top > 0:
                raise RequestError(
                    "invalid_parameter",
                    "top_logprobs: only 0 is supported (the sampled tokens' log-probabilities, no alternatives)",
                    "top_logprobs",
                )
    else:
        count = body.get("logprobs")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise RequestError("invalid_parameter", "logprobs: must be an integer >= 0", "logprobs")
        if count:
            raise RequestError(
                "invalid_parameter",
                "logprobs: only 0 is supported (the sampled tokens' log-probabilities, no alternatives)",
                "logprobs",
            )
        logprobs = count == 0
    return OutputOptions(stream, include_usage, logprobs)


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError("invalid_parameter", f"{name or key}: must be true or false", name or key)
    return value


def submit_error(e: Exception, kind: str) -> RequestError:
    """A RequestError for what encoding or queueing a parsed request raised (a chat template failure, a prompt
    longer than the context, an invalid stop string...)."""
    if isinstance(e, RequestError):
        return e
    text = str(e)
    where = "messages" if kind == "chat" else "prompt"
    if "context limit" in text:
        return RequestError("context_length_exceeded", text, where)
    if isinstance(e, ChatTemplateError):
        return RequestError("template_error", text, "messages")
    head = text.split(":")[0]
    if "=" in head:  # SamplingParams and Generation name the field: "top_p=1.5: must be in (0, 1]"
        return RequestError("invalid_parameter", text, head.split("=")[0])
    if text.startswith("stop"):  # the stop strings
        return RequestError("invalid_parameter", text, "stop")
    return RequestError("invalid_request", text, None)
