"""Reading job lines. Each line is read once into a `JobLine`, which knows its id and its shape (a plain line, or
an OpenAI Batch API line to be answered in that API's output shape) even when the rest of the line is bad, so that
its output record, answer or error, carries the right id in the right shape. `JobLine.request` then gives its
kind and request body, or raises the `jaxllama.errors` class of what is wrong with it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxllama.errors import InvalidJSON, InvalidRequest, UnsupportedEndpoint

OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclasses.dataclass(frozen=True)
class JobLine:
    """One line of a job, read but not yet checked."""

    number: int  # 1-based line number in the job file
    id: str | int  # "id", or the OpenAI "custom_id", or else the line number
    openai: bool  # an OpenAI Batch API line: answered in its output shape
    obj: Any = None  # the line's JSON value
    json_error: str | None = None  # why the line is not JSON

    def request(self) -> tuple[str, dict]:
        """The line's kind ("chat" | "completion") and request body. Raises InvalidJSON, InvalidRequest or
        UnsupportedEndpoint."""
        if self.json_error is not None:
            raise InvalidJSON(f"not valid JSON ({self.json_error})")
        if not isinstance(self.obj, dict):
            raise InvalidRequest(f"expected a JSON object, got {type(self.obj).__name__}")
        return _openai_request(self.obj) if self.openai else _plain_request(self.obj)


def read_line(raw: str, number: int) -> JobLine:
    """Read one line of a job; never raises (a bad line fails later, in `JobLine.request`).

    A line is an OpenAI Batch line when it has a "custom_id" or a "body", and its id is its "custom_id"; else
    its id is its "id". A line that is not JSON is taken for an OpenAI one when its text mentions "custom_id".
    Without a usable id (a string or an integer), the line number stands for it."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return JobLine(number, number, '"custom_id"' in raw, json_error=str(e))
    openai = isinstance(obj, dict) and ("custom_id" in obj or "body" in obj)
    rid = obj.get("custom_id" if openai else "id") if isinstance(obj, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        rid = number
    return JobLine(number, rid, openai, obj)


def _openai_request(obj: dict) -> tuple[str, dict]:
    rid = obj.get("custom_id")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest("custom_id: must be a non-empty string", "custom_id")
    url = obj.get("url")
    if url not in OPENAI_URLS:
        expected = ", ".join(OPENAI_URLS)
        raise UnsupportedEndpoint(f"url: {url!r} is not supported (expected one of {expected})", "url")
    if obj.get("method", "POST") != "POST":
        raise InvalidRequest(f"method: {obj.get('method')!r}, expected 'POST'", "method")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be a JSON object", "body")
    return OPENAI_URLS[url], body


def _plain_request(obj: dict) -> tuple[str, dict]:
    rid = obj.get("id")
    if "id" in obj and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        raise InvalidRequest(f"id: must be a string or an integer, got {rid!r}", "id")
    if "messages" in obj:
        return "chat", obj
    if "prompt" in obj:
        return "completion", obj
    raise InvalidRequest("a line needs 'messages' (chat) or 'prompt' (completion)")
