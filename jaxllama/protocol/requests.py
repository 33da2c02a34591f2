"""Reading an OpenAI-style request body (chat or completion): which fields exist and what they may hold.

`parse_body` checks a body's prompt or conversation, sampling fields, stop strings and, through `output_options`,
its delivery fields (streaming, log-probabilities). A bad field raises the `jaxllama.errors` class for its kind of
failure, naming the field as the request named it; `jaxllama.protocol.errors` turns that into an OpenAI error.
The request pipeline (`jaxllama.protocol.pipeline`) calls it for the batch runner and the server.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from jaxllama.engine.request import MAX_LOGPROBS, SamplingParams
from jaxllama.errors import InvalidParameter, InvalidRequest, is_int
from jaxllama.text.conversation import validate_messages
from jaxllama.text.structured import OutputFormat, parse_json_schema

ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
"""The kinds of request and the OpenAI path of each: where the server takes it, the "url" of an OpenAI Batch line."""

SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))
"""The sampling keywords `LLM.generate` takes: `SamplingParams`' own fields."""

LOGPROB_FIELDS = ("top_logprobs", "prompt_logprobs")
"""`SamplingParams` fields that a request body sets through its delivery fields ("logprobs", "top_logprobs",
"echo": `output_options`), in the shape its kind of answer has."""

ALIASES = {"max_completion_tokens": "max_tokens"}
"""Request fields that set a sampling field under another name (OpenAI's newer name for max_tokens)."""

REQUEST_FIELDS = {**{name: name for name in SAMPLING_FIELDS}, **ALIASES}
BOOLEAN_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.type in (bool, "bool"))
"""Request field -> `SamplingParams` field. Of two fields naming the same one, the later here wins."""

# OpenAI fields that would change the answer and are not implemented: each with the value that means "off".
UNSUPPORTED = {
    "suffix": None,
    "tools": None,
    "functions": None,
}

OUTPUT_FORMAT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar")
"""The fields that constrain the output (structured output): OpenAI's, and vLLM's guided_* (a JSON schema, a regular
expression, a Lark grammar as llguidance reads it); a request may give one."""


@dataclasses.dataclass
class ParsedBody:
    """A valid request: the conversation (chat) or the prompts (completion: texts or token id lists, one answer
    each), how to sample, the stop strings, how to deliver the answer."""

    kind: str  # "chat" | "completion"
    messages: list[dict] | None
    prompts: list[str | list[int]] | None
    params: SamplingParams
    stop: list[str]
    options: OutputOptions  # the delivery fields (`output_options`)
    model: str | None = None
    output: OutputFormat | None = None  # what the text must match
    n: int = 1  # samples of the prompt


def parse_body(body: dict, kind: str, defaults: SamplingParams, default_stop: list[str] = ()) -> ParsedBody:
    """Check a chat ("messages") or completion ("prompt") body; fields absent or null take `defaults` and
    `default_stop`. Unknown fields are ignored; fields of `UNSUPPORTED` other than their "off" value are
    refused. Raises InvalidRequest, InvalidParameter or InvalidMessages."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    surrogate = lone_surrogate_text(body)
    if surrogate is not None:
        _, field, message = surrogate
        raise InvalidRequest(message, None if field == "body" else field)
    for key, off in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != off and not (off is None and not value):
            allowed = f"only {key}={off!r} is supported" if off is not None else "it is not supported"
            raise InvalidParameter(f"{key}: {allowed}", key)
    messages = prompts = None
    if kind == "chat":
        messages = validate_messages(body.get("messages"))  # ConversationError, an InvalidMessages
    elif kind == "completion":
        prompts = completion_prompts(body.get("prompt"))
    else:
        raise ValueError(f"kind must be 'chat' or 'completion', not {kind!r}")
    options = output_options(body, kind)
    values = {k: v for k, v in body.items() if k not in LOGPROB_FIELDS}
    params = sampling_params(values, defaults, fixed=options.sampling())
    if params.max_tokens == 0 and not options.echo:
        key = next((k for k in ("max_tokens", "max_completion_tokens") if body.get(k) == 0), "max_tokens")
        raise InvalidParameter(f"{key}=0: only with echo (the prompt's log-probabilities)", key)
    stop = stop_strings(body, default_stop)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return ParsedBody(kind, messages, prompts, params, stop, options, model, output_format(body), samples(body))


MAX_N = 128
"""Samples a request may ask for: each takes a decode slot."""


def samples(values: Mapping) -> int:
    """The body's "n" (samples of the prompt, default 1); "best_of" may only repeat it (choosing the best of more
    samples than are returned is not done). Raises InvalidParameter."""
    n = values.get("n")
    n = 1 if n is None else n
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise InvalidParameter(f"n={n!r}: must be an integer from 1 to {MAX_N}", "n")
    best_of = values.get("best_of")
    if best_of is not None and best_of != n:
        raise InvalidParameter(f"best_of={best_of!r}: only best_of equal to n ({n}) is supported", "best_of")
    return n


def output_format(values: Mapping) -> OutputFormat | None:
    """What the text must match, from the fields of `OUTPUT_FORMAT_FIELDS` in `values` (a request body or
    `LLM.generate`'s keywords; None or a text response_format: nothing). Raises InvalidParameter."""
    given = [key for key in OUTPUT_FORMAT_FIELDS if values.get(key) is not None]
    given = [key for key in given if not (key == "response_format" and values[key] == {"type": "text"})]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidParameter(f"{given[1]}: give one of {', '.join(given)}, not both", given[1])
    key, value = given[0], values[given[0]]
    if key == "guided_json":
        return OutputFormat("json_schema", parse_json_schema(value, key), key)
    if key in ("guided_regex", "guided_grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidParameter(f"{key}: must be a non-empty string", key)
        return OutputFormat("regex" if key == "guided_regex" else "grammar", value, key)
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise InvalidParameter(f"response_format: must be an object whose type is one of {', '.join(kinds)}", key)
    if value["type"] == "json_object":
        return OutputFormat("json_object", None, key)
    if value["type"] == "text":
        return None
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise InvalidParameter("response_format.json_schema: must be an object with a schema", key)
    return OutputFormat("json_schema", parse_json_schema(spec["schema"], "response_format.json_schema.schema"), key)


def completion_prompts(prompt) -> list[str | list[int]]:
    """A completion's "prompt" as a list of prompts, as OpenAI reads it: a string, a list of token ids, or a list
    of either (one answer each); raises InvalidRequest."""
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        return list(prompt)
    got = "an empty list" if prompt == [] else type(prompt).__name__
    message = f"prompt: must be a string, a list of token ids, or a non-empty list of either, got {got}"
    raise InvalidRequest(message, "prompt")


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def lone_surrogate(value: object) -> tuple[str, str] | None:
    """The first string of a JSON value (a key or a value) holding a lone surrogate, which JSON's "\\udc00" escape
    reads into a str that no tokenizer nor UTF-8 output takes: (its path, e.g. "messages[0].content", the
    surrogate), or None. Iterative: the value may be deeply nested."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return path or "body", value[e.start]
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                stack += [(f"{path}.{key}" if path else str(key), item), (f"{path or 'body'} (a key)", key)]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
    return None


def lone_surrogate_text(value: object, escape: bool = True) -> tuple[str, str, str] | None:
    """Where a JSON value holds a lone surrogate (`lone_surrogate`), as a refusal says it: (its path, the path's first
    name, "PATH: holds '\\udc00', a lone surrogate escape, which is not Unicode text"), or None. `escape`: the text
    was read from JSON, whose escape made the surrogate."""
    surrogate = lone_surrogate(value)
    if surrogate is None:
        return None
    path, char = surrogate
    what = "a lone surrogate escape" if escape else "a lone surrogate"
    return path, re.split(r"[.\[ ]", path, maxsplit=1)[0], f"{path}: holds {char!r}, {what}, which is not Unicode text"


def sampling_params(values: Mapping, defaults: SamplingParams, fixed: Mapping | None = None) -> SamplingParams:
    """`defaults` with the sampling fields of `values` (a request body or `LLM.generate`'s keywords; see
    `REQUEST_FIELDS`; None means absent) and then those of `fixed` (by field name; None is a value), made, and so
    checked, once. Raises InvalidParameter naming the field as `values` named it."""
    overrides, named = {}, {}  # SamplingParams field -> value, and the request field that gave it
    for key, field in REQUEST_FIELDS.items():
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) != (field in BOOLEAN_FIELDS):
            kind = "true or false" if field in BOOLEAN_FIELDS else "a number"
            raise InvalidParameter(f"{key}: must be {kind}, got {value!r}", key)
        if field == "stop_token_ids":
            if not isinstance(value, (list, tuple)) or not all(is_int(v) for v in value):
                raise InvalidParameter(f"{key}: must be a list of integers", key)
            value = tuple(value)
        overrides[field], named[field] = value, key
    overrides.update(fixed or {})
    try:
        return dataclasses.replace(defaults, **overrides)
    except InvalidParameter as e:  # "max_tokens=-1: must be an integer >= 0"
        key = named.get(e.param, e.param)
        if key == e.param:
            raise
        why = e.message.split(": ", 1)[-1]
        raise InvalidParameter(f"{key}={values[key]!r}: {why}", key) from None


def stop_strings(body: dict, default_stop: list[str] = ()) -> list[str]:
    """The body's "stop" (a string or a list of strings) as a list; raises InvalidParameter."""
    stop = body.get("stop", list(default_stop))
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidParameter("stop: must be a non-empty string or a list of them", "stop")
    return stop


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """How the answer is delivered: streamed (with a usage chunk at the end), with log-probabilities (and
    `top_logprobs` alternatives at each token), a completion's prompt `echo`ed before it (and with `logprobs`, the
    prompt's tokens' log-probabilities too)."""

    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False

    def sampling(self) -> dict:
        """The `SamplingParams` fields (`LOGPROB_FIELDS`) that computing these log-probabilities needs."""
        top = self.top_logprobs if self.logprobs else 0
        return dict(top_logprobs=top, prompt_logprobs=top if self.echo and self.logprobs else None)


def output_options(body: dict, kind: str) -> OutputOptions:
    """The body's "stream", "stream_options", "echo" and log-probability fields (chat: "logprobs" true and
    "top_logprobs" N; completion: "logprobs" N), N alternatives at most MAX_LOGPROBS; raises InvalidParameter."""
    stream = _flag(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidParameter("stream_options: must be an object", "stream_options")
        if not stream:
            raise InvalidParameter("stream_options: only allowed with stream=true", "stream_options")
        include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    echo = False
    if kind == "chat":
        logprobs = _flag(body, "logprobs")
        top = _alternatives(body, "top_logprobs")
        if top and not logprobs:
            raise InvalidParameter("top_logprobs: needs logprobs=true", "top_logprobs")
    else:
        top = _alternatives(body, "logprobs")
        logprobs = body.get("logprobs") is not None
        echo = _flag(body, "echo")
    return OutputOptions(stream, include_usage, logprobs, top, echo)


def _alternatives(body: dict, key: str) -> int:
    count = body.get(key)
    if count is not None and (not is_int(count) or not 0 <= count <= MAX_LOGPROBS):
        raise InvalidParameter(f"{key}: must be an integer from 0 to {MAX_LOGPROBS}", key)
    return count or 0


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidParameter(f"{name or key}: must be true or false", name or key)
    return value
