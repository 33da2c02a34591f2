"""Validation of chat messages before they reach a chat template.

Requests arrive as arbitrary JSON; `validate_messages` turns a well-formed message list into plain dicts with
string contents and rejects anything else with a `ConversationError` naming the offending message and field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxllama.errors import InvalidMessages

ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool", "ipython"})
"""The message roles a conversation may use."""

TEXT_PART_SEPARATOR = "\n"
"""How the text parts of an OpenAI-style content list are joined into one string."""


class ConversationError(InvalidMessages):
    """A chat message list is malformed; the message names the offending message index and field."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param)


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check a conversation and return it as a new list of plain dicts with string contents.

    Each message must be an object with a `role` from `ROLES` and a `content` that is a string or a list of
    OpenAI content parts `{"type": "text", "text": ...}` (joined with `TEXT_PART_SEPARATOR`). An assistant
    message that carries a non-empty `tool_calls` list may omit `content` or set it to null; its `content` key
    is then left out. Other keys (`name`, `tool_calls`, `tool_call_id`, ...) are passed through unchanged.

    Raises:
        ConversationError: on anything else, e.g.
            "messages[2].role: unknown role 'robot' (expected one of ...)".
    """
    if not isinstance(messages, list):
        raise ConversationError(f"messages: expected a list of messages, got {_describe(messages)}")
    if not messages:
        raise ConversationError("messages: the conversation is empty")
    return [_validate_message(index, message) for index, message in enumerate(messages)]


def _validate_message(index: int, message: object) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        got = _describe(message)
        raise ConversationError(f"{where}: expected an object with 'role' and 'content', got {got}")
    role = _validate_role(where, message)
    validated = dict(message)
    content = message.get("content")
    if content is None:
        tool_calls = message.get("tool_calls")
        if role == "assistant" and isinstance(tool_calls, list) and tool_calls:
            validated.pop("content", None)
            return validated
        raise ConversationError(f"{where}.content: missing or null (expected a string or text parts)")
    validated["content"] = _validate_content(f"{where}.content", content)
    return validated


def _validate_role(where: str, message: Mapping) -> str:
    if "role" not in message:
        raise ConversationError(f"{where}.role: missing")
    role = message["role"]
    if not isinstance(role, str):
        raise ConversationError(f"{where}.role: expected a string, got {_describe(role)}")
    if role not in ROLES:
        expected = ", ".join(repr(name) for name in sorted(ROLES))
        raise ConversationError(f"{where}.role: unknown role {role!r} (expected one of {expected})")
    return role


def _validate_content(where: str, content: object) -> str:
    if isinstance(content, str):
        return _unicode_text(where, content)
    if not isinstance(content, list):
        got = _describe(content)
        raise ConversationError(f"{where}: expected a string or a list of text parts, got {got}")
    texts = []
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        if not isinstance(part, Mapping):
            raise ConversationError(f"{part_where}: expected a content part object, got {_describe(part)}")
        part_type = part.get("type")
        if part_type != "text":
            unsupported = f"unsupported content part type {part_type!r} (only 'text')"
            raise ConversationError(f"{part_where}.type: {unsupported}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ConversationError(f"{part_where}.text: expected a string, got {_describe(text)}")
        texts.append(_unicode_text(f"{part_where}.text", text))
    return TEXT_PART_SEPARATOR.join(texts)


def _unicode_text(where: str, text: str) -> str:
    """`text`, unless it holds a lone surrogate (JSON's "\\udc00" escape reads one): no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        message = f"{where}: holds {text[e.start]!r}, a lone surrogate, which is not Unicode text"
        raise ConversationError(message) from None
    return text


def _describe(value: object) -> str:
    """A short description of a JSON value for error messages."""
    json_names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in json_names:
        return json_names[type(value)]
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    return type(value).__name__
