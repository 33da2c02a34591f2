"""Output records: the plain shape, and the OpenAI Batch API output shape for OpenAI lines."""

from __future__ import annotations

import dataclasses
import time
import uuid

from jaxllama.batch.jobs import JobLine, LineError
from jaxllama.generation import Result


def _timings(result: Result) -> dict:
    return {k: round(v, 3) for k, v in dataclasses.asdict(result.timings).items()}


def success(job: JobLine, result: Result, model_name: str) -> dict:
    if job.openai:
        return _openai_success(job, result, model_name)
    record = {"id": job.id}
    if job.kind == "chat":
        record["message"] = {"role": "assistant", "content": result.text}
    else:
        record["text"] = result.text
    record.update(
        finish_reason=result.finish_reason, stop_reason=result.stop_reason, usage=result.usage, timings=_timings(result)
    )
    return record


def _openai_success(job: JobLine, result: Result, model_name: str) -> dict:
    request_id = uuid.uuid4().hex
    created = int(time.time())
    model = job.model or model_name
    if job.kind == "chat":
        body = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                }
            ],
        }
    else:
        body = {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
        }
    body["usage"] = result.usage
    body["stop_reason"] = result.stop_reason
    body["timings"] = _timings(result)
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": job.id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def failure(error: LineError, rid, openai: bool) -> dict:
    if openai:
        request_id = uuid.uuid4().hex
        body = {
            "error": {
                "message": error.message,
                "type": "invalid_request_error",
                "param": None,
                "code": error.code,
                "line": error.line,
            }
        }
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
