"""Reading job lines: each line's shape is detected on its own (chat, plain prompt, OpenAI Batch API), and a
bad line becomes a `LineError` naming the line and the field, never an exception that stops the job."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxllama.engine.request import SamplingParams
from jaxllama.protocol.requests import RequestError, parse_body

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

    try:
        parsed = parse_body(body, kind, defaults, default_stop)
    except RequestError as e:
        raise LineError(e.code, e.message, number) from None
    messages = parsed.messages
    if messages is not None and system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return JobLine(number, rid, kind, openai, messages, parsed.prompt, parsed.params, parsed.stop, parsed.model)
