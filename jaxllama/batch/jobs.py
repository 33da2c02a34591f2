"""Reading job lines. Each line is read once into a `JobLine`, which knows its id and its shape (a plain line, or
an OpenAI Batch API line to be answered in that API's output shape) even when the rest of the line is bad, so that
its output record, answer or error, carries the right id in the right shape. `JobLine.request` then gives its
kind and request body, or raises the `jaxllama.errors` class of what is wrong with it.

Whatever a line holds (bytes that are not UTF-8, JSON nested past Python's recursion limit, a lone surrogate
escape), reading it never raises: one bad line costs that line only, in this run and in every rerun."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxllama.errors import InvalidJSON, InvalidRequest, UnsupportedEndpoint
from jaxllama.protocol.requests import ENDPOINTS, lone_surrogate_text

OPENAI_URLS = {url: kind for kind, url in ENDPOINTS.items()}  # an OpenAI Batch line's "url" -> its kind


@dataclasses.dataclass(frozen=True)
class JobLine:
    """One line of a job, read but not yet checked."""

    number: int  # 1-based line number in the job file
    id: str | int  # "id", or the OpenAI "custom_id", or else the line number
    openai: bool  # an OpenAI Batch API line: answered in its output shape
    obj: Any = None  # the line's JSON value
    problem: InvalidRequest | None = None  # why the line cannot be read (not UTF-8, not JSON, not Unicode text)

    def request(self) -> tuple[str, dict]:
        """The line's kind ("chat" | "completion") and request body. Raises InvalidJSON, InvalidRequest or
        UnsupportedEndpoint."""
        if self.problem is not None:
            raise self.problem
        if not isinstance(self.obj, dict):
            raise InvalidRequest(f"expected a JSON object, got {type(self.obj).__name__}")
        return _openai_request(self.obj) if self.openai else _plain_request(self.obj)


def read_job(job: Path) -> list[JobLine]:
    """The job's lines (blank ones left out, the others keeping their line numbers). Raises OSError if the file
    cannot be read; what is in it never fails more than the lines it is in."""
    return list(stream_job(job))


def stream_job(job: Path) -> Iterator[JobLine]:
    """The job's lines as `read_job` gives them, read as they are asked for: a job of any length in the memory of a
    line."""
    for number, raw in _raw_lines(job):
        if line := read_bytes(raw, number):
            yield line


def count_lines(job: Path) -> int:
    """The job's lines that are not blank (OSError if the file cannot be read)."""
    return sum(1 for _, raw in _raw_lines(job) if raw.strip())


def _raw_lines(job: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each JSONL line: lines end at "\\n" only (U+2028, U+2029, U+0085 and a bare CR are
    legal inside JSON strings); a "\\r" before the "\\n" and a UTF-8 byte order mark at the start are no part of a
    line. OSError, naming the file, where it cannot be read."""
    try:
        f = open(job, "rb")  # noqa: SIM115 - closed below, after the last line is yielded
    except OSError as e:
        raise OSError(f"{job}: cannot read the job file ({e})") from None
    with f:
        for number, raw in enumerate(f, start=1):  # a binary file's lines end at b"\n" alone
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            raw = raw[:-1] if raw.endswith(b"\n") else raw
            yield number, raw[:-1] if raw.endswith(b"\r") else raw


def read_bytes(raw: bytes, number: int) -> JobLine | None:
    """Read one line of a job from its bytes; None for a blank line. Never raises."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        problem = InvalidJSON(f"not valid UTF-8 (byte {e.start + 1} of the line: {raw[e.start : e.start + 1]!r})")
        return JobLine(number, number, b'"custom_id"' in raw, problem=problem)
    return read_line(text, number) if text.strip() else None


def read_line(raw: str, number: int) -> JobLine:
    """Read one line of a job; never raises (a bad line fails later, in `JobLine.request`).

    A line is an OpenAI Batch line when it has a "custom_id" or a "body", and its id is its "custom_id"; else
    its id is its "id". A line that is not JSON is taken for an OpenAI one when its text mentions "custom_id".
    Without a usable id (a string or an integer), the line number stands for it."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: arrays or objects nested too deep
        return JobLine(number, number, '"custom_id"' in raw, problem=InvalidJSON(f"not valid JSON ({e})"))
    openai = isinstance(obj, dict) and ("custom_id" in obj or "body" in obj)
    rid = obj.get("custom_id" if openai else "id") if isinstance(obj, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        rid = number
    # A lone surrogate ("\\udc00", only an escape can make one) fails its line here, even in the id or an OpenAI
    # line's custom_id, which the request pipeline's own check (of the body) does not see.
    surrogate = lone_surrogate_text(obj) if "\\u" in raw else None
    if surrogate is not None:
        _, field, message = surrogate
        return JobLine(number, rid, openai, problem=InvalidRequest(message, field))
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
