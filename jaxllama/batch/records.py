"""Output records: the plain shape, and the OpenAI Batch API output shape for OpenAI lines."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

from jaxllama.batch.jobs import JobLine
from jaxllama.protocol import answers, errors, responses
from jaxllama.protocol.pipeline import PreparedRequest

if TYPE_CHECKING:
    from jaxllama.results import Result


def success(line: JobLine, request: PreparedRequest, result: Result | list[Result], model_name: str, tokenizer) -> dict:
    """The answer to a line: `{"id", "message" | "text", "finish_reason", "stop_reason", "usage", "timings"}` (and
    `logprobs`, in the server's shape, when the line asked for them); for a line asking for n > 1 samples (`result`:
    their list), `{"id", "choices", "usage", "timings"}` with the choices as the server answers them."""
    if line.openai:
        return _openai_success(line, request, result, model_name, tokenizer)
    if isinstance(result, list):
        body = answers.answer(request, [result], model_name, tokenizer)
        keep = (lambda k: True) if request.options.logprobs else (lambda k: k != "logprobs")
        choices = [{k: v for k, v in c.items() if keep(k)} for c in body["choices"]]
        return {"id": line.id, "choices": choices, "usage": body["usage"], "timings": body["timings"]}
    record = {"id": line.id}
    choice = answers.answer(request, [[result]], model_name, tokenizer)["choices"][0]
    if request.kind == "chat":
        record["message"] = choice["message"]
    else:
        record["text"] = choice["text"]
    if request.options.logprobs:
        record["logprobs"] = choice["logprobs"]
    record.update(
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        usage=result.usage,
        timings=responses.timings(result),
    )
    return record


def _openai_success(
    line: JobLine, request: PreparedRequest, result: Result | list[Result], model_name: str, tokenizer
) -> dict:
    body = answers.answer(request, [result if isinstance(result, list) else [result]], model_name, tokenizer)
    request_id = body["id"].split("-", 1)[1]
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": line.id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def failure(line: JobLine, error: Exception) -> dict:
    """The error record of a line that cannot run: `{"id", "error": {"code", "message", "line"}}`, or for an
    OpenAI line a response with the HTTP status and OpenAI error object the server would answer (the line
    number added)."""
    answer = errors.failure(error)
    if line.openai:
        request_id = uuid.uuid4().hex
        body = responses.error(answer.message, answer.code)
        body["error"]["line"] = line.number
        return {
            "id": f"batch_req_{request_id}",
            "custom_id": line.id,
            "response": {"status_code": answer.status, "request_id": request_id, "body": body},
            "error": None,
        }
    return {"id": line.id, "error": {"code": answer.code, "message": answer.message, "line": line.number}}


def record_id(record: dict):
    """The id a record answers (for resume): custom_id for OpenAI records, else id."""
    return record["custom_id"] if "custom_id" in record else record.get("id")


def is_error(record: dict) -> bool:
    """Whether a record is a line's error record (plain or OpenAI shape) rather than its answer."""
    if "custom_id" in record:
        response = record.get("response")
        return record.get("error") is not None or not isinstance(response, dict) or response.get("status_code") != 200
    return "error" in record


def dumps(record: dict) -> str:
    """A record as one line of JSON (no newline). Text stays as it is (UTF-8) unless the record holds a lone
    surrogate (an id read from a "\\udc00" escape), which only an ASCII escape can write; it reads back the same."""
    text = json.dumps(record, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(record)
    return text
