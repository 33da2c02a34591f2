"""Why a request cannot run: one class per kind of failure, raised where the condition is found.

They live at the bottom of the package (this module imports nothing of jaxllama) so that every layer can raise
them: the sampling parameters and the engine (a prompt past the context), the text layer (a conversation or a chat
template), the request pipeline (a body's fields). Only the protocol layer turns them into OpenAI error codes and
HTTP statuses (`jaxllama.protocol.errors`), by class, never by message. The request errors are ValueErrors: a
caller that only needs to know "this request is bad" can catch that. Three are failures of the service (busy,
stopped, its client gone), not of the request; `CheckpointError` is a bad model on disk, and `InvalidOption` a bad
option of a load or an engine (the command line's, `LLM.load`'s). `is_int` is the one type check their callers
share.
"""

from __future__ import annotations


class InvalidOption(ValueError):
    """An option of a load or an engine (`LLM.load`'s keywords, `EngineOptions`' fields) out of its range: its
    `name`, its `value` and what it must be (`expected`), kept apart so that a front end can name the option as its
    user spelled it (a command-line flag)."""

    def __init__(self, name: str, value, expected: str):
        super().__init__(f"{name}={value!r}: {expected}")
        self.name, self.value, self.expected = name, value, expected


class RequestError(ValueError):
    """A request that cannot run. `message` is for people; `param` names the request field at fault, if any."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param

    def __str__(self) -> str:
        return self.message


class InvalidRequest(RequestError):
    """The request's shape is wrong: not an object, no prompt, an unknown kind of line."""


class InvalidJSON(InvalidRequest):
    """A job line that is not JSON."""


class InvalidParameter(RequestError):
    """A field holds a value out of its range or of the wrong type, or asks for something not supported."""


class InvalidMessages(RequestError):
    """A conversation that is not a list of well-formed messages."""


class TemplateError(RequestError):
    """The chat template failed on a conversation."""


class ContextLengthExceeded(RequestError):
    """The prompt leaves no room for a generated token within the context."""


class DuplicateId(RequestError):
    """A job line reuses an id an earlier line has."""


class UnsupportedEndpoint(RequestError):
    """An OpenAI Batch line whose url is not an endpoint jaxllama serves."""


# Failures of the service rather than of the request: the same request may run later.


class QueueFull(Exception):
    """Every slot is busy and the queue of waiting requests is full."""


class EngineUnavailable(RuntimeError):
    """The engine is not running: stopped, or failed (the message says why)."""


class ClientClosed(Exception):
    """The client went away before its answer was ready."""


class ReplicaLost(RuntimeError):
    """Every replica that took a job line died before answering it, as many times as a line is tried: the line
    (or what it asks of the engine) is taken to kill replicas, and answered with this instead of being tried again."""


# Failures of the model on disk: no request can run until it is replaced.


class CheckpointError(ValueError):
    """A checkpoint (a converted one, or a source to convert) that cannot be used: a missing, truncated or garbled
    file, a config value out of range, or a config that does not match the arrays stored. The message names the
    file and the field or tensor at fault."""


class ModelTooLarge(MemoryError):
    """The model's weights, as its backend runs them, do not fit in the memory there is (checked before loading);
    the message gives both figures."""


def is_int(value: object) -> bool:
    """An int and not a bool: Python counts True as 1, but JSON's true is no count, index or token id."""
    return isinstance(value, int) and not isinstance(value, bool)
