"""The one map from failures to OpenAI error codes and HTTP statuses.

Every layer raises a `jaxllama.errors` class where it finds a failure; the batch runner and the server both turn
it into an answer here, by its class (the first of its bases found in `ERRORS`), never by its message. A job
line and an HTTP request that fail the same way therefore get the same code.
"""

from __future__ import annotations

import dataclasses

from jaxllama.errors import (
    CheckpointError,
    ClientClosed,
    ContextLengthExceeded,
    DuplicateId,
    EngineUnavailable,
    InvalidJSON,
    InvalidMessages,
    InvalidOption,
    InvalidParameter,
    InvalidRequest,
    ModelTooLarge,
    QueueFull,
    ReplicaLost,
    RequestError,
    TemplateError,
    UnsupportedEndpoint,
)
from jaxllama.protocol import responses


@dataclasses.dataclass(frozen=True)
class ErrorKind:
    """How one class of failure is answered: OpenAI's `code` and error `type`, and the HTTP `status`."""

    code: str
    status: int
    type: str = "invalid_request_error"
    about_prompt: bool = False  # without a param of its own, it names the prompt: "messages" or "prompt"


ERRORS: dict[type[BaseException], ErrorKind] = {
    InvalidJSON: ErrorKind("invalid_json", 400),
    UnsupportedEndpoint: ErrorKind("invalid_url", 400),
    InvalidRequest: ErrorKind("invalid_request", 400),
    InvalidParameter: ErrorKind("invalid_parameter", 400),
    InvalidMessages: ErrorKind("invalid_messages", 400, about_prompt=True),
    TemplateError: ErrorKind("template_error", 400, about_prompt=True),
    ContextLengthExceeded: ErrorKind("context_length_exceeded", 400, about_prompt=True),
    DuplicateId: ErrorKind("duplicate_id", 400),
    RequestError: ErrorKind("invalid_request", 400),
    # A request the engine refuses with a plain ValueError (a check without a class of its own).
    ValueError: ErrorKind("invalid_request", 400),
    QueueFull: ErrorKind("queue_full", 429, "rate_limit_error"),
    EngineUnavailable: ErrorKind("engine_unavailable", 503, "server_error"),
    ClientClosed: ErrorKind("client_closed", 499),
    ReplicaLost: ErrorKind("replica_lost", 503, "server_error"),
    CheckpointError: ErrorKind("model_error", 503, "server_error"),
    ModelTooLarge: ErrorKind("model_too_large", 503, "server_error"),
    # The engine's own options (a load's), not the request's: the service is misconfigured.
    InvalidOption: ErrorKind("invalid_option", 503, "server_error"),
    Exception: ErrorKind("internal_error", 500, "server_error"),
}

INTERNAL = ERRORS[Exception]
"""An unexpected exception: a fault of jaxllama's, not of the request."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failure as answered: its kind (code, status, type), a message for people, the request field at fault."""

    kind: ErrorKind
    message: str
    param: str | None = None

    @property
    def code(self) -> str:
        return self.kind.code

    @property
    def status(self) -> int:
        return self.kind.status

    def body(self) -> dict:
        """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
        return responses.error(self.message, self.code, self.param, self.kind.type)


def error_kind(error: BaseException) -> ErrorKind:
    """The `ERRORS` entry of the error's class or of its nearest base there."""
    for cls in type(error).__mro__:
        if cls in ERRORS:
            return ERRORS[cls]
    return INTERNAL


def failure(error: BaseException, kind: str | None = None) -> Failure:
    """How `error`, raised while handling a request of `kind` ("chat" | "completion"), is answered."""
    found = error_kind(error)
    if found is INTERNAL:
        return internal_failure(error)
    message = error.message if isinstance(error, RequestError) else str(error)
    param = getattr(error, "param", None)
    if param is None and found.about_prompt and kind is not None:
        param = "messages" if kind == "chat" else "prompt"
    return Failure(found, message, param)


def internal_failure(error: BaseException) -> Failure:
    """An exception nothing expected (whatever its class): answered 500, "internal_error"."""
    return Failure(INTERNAL, f"internal error: {error!r}")
