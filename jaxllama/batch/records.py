"""Output records: the plain shape, and the OpenAI Batch API output shape for OpenAI lines."""

from __future__ import annotations

import uuid

from jaxllama.batch.jobs import JobLine, LineError
from jaxllama.generation import Result
from jaxllama.protocol import responses


def success(job: JobLine, result: Result, model_name: str) -> dict:
    if job.openai:
        return _openai_success(job, result, model_name)
    record = {"id": job.id}
    if job.kind == "chat":
        record["message"] = {"role": "assistant", "content": result.text}
    else:
        record["text"] = result.text
    record.update(
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        usage=result.usage,
        timings=responses.timings(result),
    )
    return record


def _openai_success(job: JobLine, result: Result, model_name: str) -> dict:
    body = responses.completion(job.kind, result, job.model or model_name)
    request_id = body["id"].split("-", 1)[1]
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": job.id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def failure(error: LineError, rid, openai: bool) -> dict:
    if openai:
        request_id = uuid.uuid4().hex
        body = responses.error(error.message, error.code)
        body["error"]["line"] = error.line
        return {
            "id": f"batch_req_{request_id}",
            "custom_id": rid,
            "response": {"status_code": 400, "request_id": request_id, "body": body},
            "error": None,
        }
    return {"id": rid, "error": {"code": error.code, "message": error.message, "line": error.line}}


def record_id(record: dict):
    """The id a record answers (for resume): custom_id for OpenAI records, else id."""
    return record["custom_id"] if "custom_id" in record else record.get("id")
