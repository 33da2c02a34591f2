"""OpenAI response objects: chat completions, text completions, their streamed chunks, and errors.

Plain dicts in the shapes of OpenAI's API (what its `openai` client parses), with two additions that
clients ignore: `stop_reason` on a choice (the stop string or token id that ended it) and `timings`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import TYPE_CHECKING

from jaxllama.results import usage as usage_of

if TYPE_CHECKING:
    from jaxllama.results import Result


def new_id(kind: str) -> str:
    """A fresh response id: "chatcmpl-..." for chat, "cmpl-..." for completions."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def timings(result: Result) -> dict:
    return {k: round(v, 3) for k, v in dataclasses.asdict(result.timings).items()}


def completion(
    kind: str,
    result: Result | list[Result],
    model: str,
    *,
    id: str | None = None,
    logprobs: dict | list[dict | None] | None = None,
    texts: list[str] | None = None,
    usage: dict | None = None,
) -> dict:
    """The whole answer: a `chat.completion` (kind "chat") or a `text_completion` (kind "completion"), with one
    choice per result (a request's n samples, in order; `logprobs` then one per result). `texts`: each choice's
    text, where it is not its result's (an echoed prompt before it); `usage`: the answer's, where it is not that of
    one prompt's samples (several prompts)."""
    results = result if isinstance(result, list) else [result]
    logprobs = logprobs if isinstance(logprobs, list) else [logprobs] * len(results)
    texts = texts or [r.text for r in results]
    return {
        "id": id or new_id(kind),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            _choice(kind, i, r, lp, text) for i, (r, lp, text) in enumerate(zip(results, logprobs, texts, strict=True))
        ],
        "usage": usage or usage_of([results]),
        "timings": timings(results[0]),
    }


def _choice(kind: str, index: int, result: Result, logprobs: dict | None, text: str) -> dict:
    choice = {"index": index}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=logprobs, finish_reason=result.finish_reason, stop_reason=result.stop_reason)
    return choice


@dataclasses.dataclass(frozen=True)
class Stream:
    """What every chunk of one streamed answer repeats: its kind ("chat" or "completion"), id, creation time and
    model, and whether each chunk carries "usage" (`stream_options.include_usage`)."""

    kind: str
    id: str
    created: int
    model: str
    include_usage: bool = False

    @classmethod
    def start(cls, kind: str, model: str, include_usage: bool = False) -> Stream:
        return cls(kind, new_id(kind), int(time.time()), model, include_usage)

    def _header(self) -> dict:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def chunk(
    stream: Stream,
    text: str | None = None,
    *,
    role: bool = False,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """One streamed piece: a `chat.completion.chunk` or a `text_completion` with one choice (the request's choice
    `index`, of its n samples). `role` opens a chat stream; `finish_reason` closes the choice. With the stream's
    `include_usage` every chunk has "usage", null (the usage comes last, in a chunk of no choices: `usage_chunk`)."""
    if stream.kind == "chat":
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    choice.update(logprobs=logprobs, finish_reason=finish_reason)
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    out = {**stream._header(), "choices": [choice]}
    if stream.include_usage:
        out["usage"] = None
    return out


def usage_chunk(stream: Stream, result: Result | list[Result]) -> dict:
    """The last chunk of a stream asked with `stream_options.include_usage`: no choices, the usage (of every
    choice: `result` may be the request's n results)."""
    results = result if isinstance(result, list) else [result]
    return {**stream._header(), "choices": [], "usage": usage_of([results]), "timings": timings(results[0])}


LOGPROB_FLOOR = -9999.0
"""What a log-probability that is not a finite number (NaN or -inf, e.g. after an extreme repetition penalty) is
answered as, whole or streamed: JSON has no NaN or infinity, and vLLM answers the same floor."""


def finite_logprobs(logprobs: list[float]) -> list[float]:
    """`logprobs` with every value that is not finite replaced by `LOGPROB_FLOOR`."""
    return [float(lp) if math.isfinite(lp) else LOGPROB_FLOOR for lp in logprobs]


def error(message: str, code: str | None = None, param: str | None = None, type: str = "invalid_request_error") -> dict:
    """The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
