"""Reading job lines: each line's shape is detected on its own (chat, plain prompt, OpenAI Batch API), and a
bad line becomes a `LineError` naming the line and the field, never an exception that stops the job."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxllama.engine.sampling import SamplingParams
from jaxllama.text.conversation import ConversationError, validate_messages

# Per-line parameter -> SamplingParams field.
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
OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclasses.dataclass
class LineError(Exception):
    """A line that cannot run: code (machine-readable), message (for people), line number (1-based)."""

    code: str
    message: str
    line: int

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclasses.dataclass
class JobLine:
    """One parsed request."""

    line: int  # 1-based line number in the job file
    id: Any  # "id", or the OpenAI "custom_id", or the line number
    kind: str  # "chat" | "completion"
    openai: bool  # OpenAI Batch API line: answer in its output shape
    messages: list[dict] | None
    prompt: str | None
    params: SamplingParams
    stop: list[str]
    model: str | None = None


def line_id(raw: str, number: int):
    """The id of a line for resume and error records, even when the line is otherwise bad."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return number
    if isinstance(obj, dict):
        for key in ("id", "custom_id"):
            if isinstance(obj.get(key), (str, int)) and not isinstance(obj.get(key), bool):
                return obj[key]
    return number


def parse_line(
    raw: str, number: int, defaults: SamplingParams, default_stop: list[str], system_prompt: str | None = None
) -> JobLine:
    """Parse one line; raises LineError."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise LineError("invalid_json", f"not valid JSON ({e})", number) from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"expected a JSON object, got {type(obj).__name__}", number)
    openai = "custom_id" in obj or "body" in obj
    if openai:
        rid = obj.get("custom_id")
        if not isinstance(rid, str) or not rid:
            raise LineError("invalid_request", "custom_id: must be a non-empty string", number)
        url = obj.get("url")
        if url not in OPENAI_URLS:
            raise LineError(
                "invalid_url", f"url: {url!r} is not supported (expected one of {', '.join(OPENAI_URLS)})", number
            )
        if obj.get("method", "POST") != "POST":
            raise LineError("invalid_request", f"method: {obj.get('method')!r}, expected 'POST'", number)
        body = obj.get("body")
        if not isinstance(body, dict):
            raise LineError("invalid_request", "body: must be a JSON object", number)
        kind = OPENAI_URLS[url]
    else:
        rid = obj.get("id", number)
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise LineError("invalid_request", f"id: must be a string or an integer, got {rid!r}", number)
        body = obj
        if "messages" in obj:
            kind = "chat"
        elif "prompt" in obj:
            kind = "completion"
        else:
            raise LineError("invalid_request", "a line needs 'messages' (chat) or 'prompt' (completion)", number)

    if body.get("n", 1) != 1:
        raise LineError("invalid_parameter", "n: only n=1 is supported", number)
    messages = prompt = None
    if kind == "chat":
        try:
            messages = validate_messages(body.get("messages"))
        except ConversationError as e:
            raise LineError("invalid_messages", str(e), number) from None
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise LineError("invalid_request", f"prompt: must be a string, got {type(prompt).__name__}", number)
    params, stop = _sampling(body, defaults, default_stop, number)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return JobLine(number, rid, kind, openai, messages, prompt, params, stop, model)


def _sampling(body: dict, defaults: SamplingParams, default_stop: list[str], number: int):
    overrides = {}
    for key, field in PARAMETERS.items():
        if key in body and body[key] is not None:
            value = body[key]
            if field == "stop_token_ids":
                if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                    raise LineError("invalid_parameter", f"{key}: must be a list of integers", number)
                value = tuple(value)
            overrides[field] = value
    try:
        params = dataclasses.replace(defaults, **overrides)
    except ValueError as e:
        raise LineError("invalid_parameter", str(e), number) from None
    except TypeError as e:
        raise LineError("invalid_parameter", str(e), number) from None
    stop = body.get("stop", default_stop)
    if stop is None:
        stop = []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise LineError("invalid_parameter", "stop: must be a non-empty string or a list of them", number)
    return params, stop
