"""The token ids that end generation: EOS, the generation config's EOS ids, the template's end-of-turn tokens.

A chat model ends an answer with its end-of-turn token (`<|eot_id|>`, `<|im_end|>`, ...), which is often not
the tokenizer's EOS, so the set gathers every id a checkpoint declares or its chat template writes.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxllama.text.chat_template import end_of_turn_tokens

if TYPE_CHECKING:
    from jaxllama.text.tokenizer import Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"


def end_of_generation_ids(
    tokenizer: Tokenizer,
    *,
    generation_config: dict[str, Any] | None,
    template_text: str | None,
    override: Iterable[int] | None = None,
    extra: Iterable[int] = (),
) -> frozenset[int]:
    """The ids whose sampling ends a sequence.

    The default set is `tokenizer.eos_id`, the generation config's `eos_token_id` (an int or a list), and the
    ids of the end-of-turn tokens the chat template writes (see `end_of_turn_tokens`) that the vocabulary has.
    `override` replaces that set; `extra` is added to whichever set is used. The result may be empty: then
    only a length limit ends generation.

    Raises:
        ValueError: an id that is not an int in `[0, tokenizer.vocab_size)`, or a malformed `eos_token_id`.
    """
    if override is not None:
        ids = set(_checked_ids(override, tokenizer.vocab_size, "override"))
    else:
        ids = set(_generation_config_eos_ids(generation_config or {}, tokenizer.vocab_size))
        if tokenizer.eos_id is not None:
            ids.add(tokenizer.eos_id)
        for token in end_of_turn_tokens(template_text or ""):
            token_id = tokenizer.token_to_id(token)
            if token_id is not None:
                ids.add(token_id)
    ids.update(_checked_ids(extra, tokenizer.vocab_size, "extra"))
    return frozenset(ids)


def load_generation_config(path: str | Path) -> dict[str, Any]:
    """A checkpoint's `generation_config.json` as a dict ({} when there is none).

    Args:
        path: a checkpoint folder, or the JSON file itself.

    Raises:
        ValueError: the file is not valid JSON or not a JSON object.
    """
    path = Path(path)
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _generation_config_eos_ids(generation_config: dict[str, Any], vocab_size: int) -> list[int]:
    eos = generation_config.get("eos_token_id")
    if eos is None:
        return []
    if isinstance(eos, list):
        return _checked_ids(eos, vocab_size, "generation_config.eos_token_id")
    return _checked_ids([eos], vocab_size, "generation_config.eos_token_id")


def _checked_ids(ids: Iterable[int], vocab_size: int, source: str) -> list[int]:
    checked = []
    for token_id in ids:
        value = None if isinstance(token_id, bool) else _as_int(token_id)
        if value is None or not 0 <= value < vocab_size:
            raise ValueError(f"{source}: {token_id!r} is not a token id (an int in [0, {vocab_size}))")
        checked.append(value)
    return checked


def _as_int(value: object) -> int | None:
    """The value as a Python int when it is integral (int, numpy integer), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None
