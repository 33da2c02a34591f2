"""Chat templates: Jinja rendering compatible with transformers' `apply_chat_template`, and chat encoding.

Templates render in the same sandboxed Jinja environment transformers uses (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`, the `{% generation %}` tag), with the
same variables: `messages`, `add_generation_prompt`, `tools`, `documents`, `bos_token`, `eos_token` and any
extra keyword arguments. Templates come from checkpoints and are untrusted code, hence the immutable sandbox,
with a budget of work, time and size (`jaxllama.text.template_sandbox`).

`encode_chat` keeps message contents text: only the template's own markup yields special tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from jaxllama import errors
from jaxllama.text.builtin_templates import BUILTIN_TEMPLATES
from jaxllama.text.template_sandbox import BoundedSandbox, RenderLimitExceeded, render_bounded

if TYPE_CHECKING:
    from jaxllama.text.tokenizer import Tokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

END_OF_TURN_TOKENS: tuple[str, ...] = (
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3.1+ (end of message, a tool call follows)
    "<|eot|>",  # Llama 4
    "<|eom|>",  # Llama 4
    "<|im_end|>",  # ChatML
    "</s>",  # Llama 2 / Mistral templates that write EOS literally
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
    "<|END_OF_TURN_TOKEN|>",  # Command R
    "<｜end▁of▁sentence｜>",  # DeepSeek
)
"""Token texts that close a turn in common chat formats, looked for in a template's source."""


class ChatTemplateError(errors.TemplateError):
    """A chat template is missing, invalid, or refused to render (e.g. through `raise_exception`)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template.

    Attributes:
        source: the Jinja source.
        name: where it came from (a built-in name, a file or checkpoint path), for messages and logs.
    """

    source: str
    name: str = "custom"

    def __post_init__(self) -> None:
        _compile(self.source, self.name)  # fail early on a syntax error

    @classmethod
    def builtin(cls, name: str) -> ChatTemplate:
        """A built-in template: one of `BUILTIN_TEMPLATES` (`llama2`, `llama3`, `chatml`, `raw`)."""
        if name not in BUILTIN_TEMPLATES:
            expected = _builtin_names()
            raise ChatTemplateError(f"unknown built-in chat template {name!r} (expected one of {expected})")
        return cls(BUILTIN_TEMPLATES[name], name=name)

    @classmethod
    def from_name_or_file(cls, name_or_path: str | Path) -> ChatTemplate:
        """A built-in template by name, or the template in a Jinja file."""
        if str(name_or_path) in BUILTIN_TEMPLATES:
            return cls.builtin(str(name_or_path))
        path = Path(name_or_path)
        if not path.is_file():
            raise ChatTemplateError(
                f"unknown chat template {str(name_or_path)!r}: neither a built-in ({_builtin_names()}) "
                "nor an existing template file"
            )
        return cls(path.read_text(encoding="utf-8"), name=str(path))

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, override: str | None = None, *, special_tokens: Iterable[str] = ()
    ) -> ChatTemplate:
        """The chat template to use with a checkpoint.

        Args:
            path: a checkpoint folder, or a `.gguf` file.
            override: a built-in name or a `.jinja` file to use instead of the checkpoint's template.
            special_tokens: the tokenizer's special token texts (e.g. `tokenizer.special_tokens`), which
                pick a built-in template when the checkpoint has none (see `default_template_name`).
        """
        if override is not None:
            return cls.from_name_or_file(override)
        source = read_checkpoint_template(path)
        if source is not None:
            return cls(source, name=str(path))
        return cls.builtin(default_template_name(special_tokens))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to text, exactly as transformers' `apply_chat_template(tokenize=False)` does.

        As in transformers, keys whose value is None are dropped from each message, everything the template
        sees is rebuilt from plain data, and a special token that is None is left undefined (it renders as
        nothing) rather than rendering as "None". Unlike transformers, `add_generation_prompt` defaults to True:
        the usual case here is prompting the model for its answer.

        Rendering is bounded (`jaxllama.text.template_sandbox`): a template that loops or grows strings
        past the budget is stopped.

        Raises:
            ChatTemplateError: the template called `raise_exception` (the error carries its message), failed,
                or went over its rendering budget.
        """
        special_tokens = {"bos_token": bos_token, "eos_token": eos_token}
        variables = {key: value for key, value in special_tokens.items() if value is not None}
        variables.update({key: _plain(value) for key, value in kwargs.items()})
        variables.update(
            messages=_plain_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return render_bounded(_compile(self.source, self.name), variables)
        except ChatTemplateError:
            raise
        except RenderLimitExceeded as error:
            raise ChatTemplateError(f"chat template {self.name!r} refused: {error}") from None
        except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as error:
            # The template's own failure (`{{ 1 / 0 }}`, `{{ x[99] }}`): untrusted code, not a fault of jaxllama's.
            raise ChatTemplateError(f"chat template {self.name!r} failed to render: {error}") from error


def encode_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Render a conversation with `template` and encode it: the template's markup with its special tokens, the
    messages' contents as plain text.

    Special-token text in a content ("<|eot_id|>", "<|im_end|>") is encoded as text, as Meta's `ChatFormat`
    encodes contents, so that a message cannot close its own turn and forge another (see `markup_specials`).
    BOS is prepended only when the tokenizer adds one (`add_bos`) and the rendered text does not already start
    with `bos_token`, so a template that writes `{{ bos_token }}` never yields two BOS tokens. Messages are
    rendered as given; check untrusted ones with `jaxllama.text.conversation.validate_messages` first.

    Raises:
        ChatTemplateError: the template failed, or it renders a content holding special-token text in a way
            that does not let that text be told from the markup (see `markup_specials`).
    """
    variables = dict(add_generation_prompt=add_generation_prompt, bos_token=tokenizer.bos_token)
    variables.update(eos_token=tokenizer.eos_token, **kwargs)
    text = template.render(messages, **variables)
    specials = markup_specials(tokenizer, template, messages, text, variables)
    bos = tokenizer.bos_token
    starts_with_bos = bool(bos) and text.startswith(bos) and (specials is None or (0, len(bos)) in specials)
    add_bos = tokenizer.add_bos and tokenizer.bos_id is not None and not starts_with_bos
    if specials is None:
        return tokenizer.encode(text, add_bos=add_bos, allow_special=True)
    return tokenizer.encode_with_specials(text, specials, add_bos=add_bos)


def markup_specials(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    text: str,
    variables: Mapping[str, Any],
) -> list[tuple[int, int]] | None:
    """The (start, end) spans of `text` (the rendered conversation) that are the template's special tokens, when
    some message holds special-token text (in its content, or any other string: a name, tool call arguments);
    None when none does (every special token in `text` is markup).

    The conversation is rendered again with each special-token text in the messages replaced by as many
    `_STAND_IN` characters: the special tokens of that rendering are the markup's. When the two renderings agree
    everywhere but at stand-ins (the template writes contents as they are, trimmed, cased, escaped as JSON, ...),
    its special tokens are at the same places in `text`. Otherwise ChatTemplateError is raised, rather than let a
    message's special-token text become a special token.
    """
    stand_ins = [_stand_in(tokenizer, message) for message in messages]
    if all(stand_in is message for stand_in, message in zip(stand_ins, messages, strict=True)):
        return None
    safe = template.render(stand_ins, **variables)
    if len(safe) != len(text) or any(
        text[match.start() : match.end()] != match.group() for match in re.finditer(f"[^{_STAND_IN}]+", safe)
    ):
        index = next(i for i, (s, m) in enumerate(zip(stand_ins, messages, strict=True)) if s is not m)
        raise ChatTemplateError(
            f"messages[{index}] holds special-token text, and chat template {template.name!r} changes the message "
            "as it writes it so that this text cannot be told from the template's own special tokens"
        )
    return tokenizer.special_spans(safe)


_STAND_IN = "\ue000"  # a private-use character: no special token's text, nor whitespace a template would trim


def _stand_in(tokenizer: Tokenizer, value: Any) -> Any:
    """`value` (a message, or any value in one) with the special-token text in its strings replaced by
    stand-ins; `value` itself when it has none."""
    if isinstance(value, str):
        spans = tokenizer.special_spans(value)
        pieces, end = [], 0
        for start, stop in spans:
            pieces += [value[end:start], _STAND_IN * (stop - start)]
            end = stop
        return "".join([*pieces, value[end:]]) if spans else value
    if isinstance(value, Mapping):
        items = {key: _stand_in(tokenizer, item) for key, item in value.items()}
        return items if any(items[key] is not item for key, item in value.items()) else value
    if isinstance(value, (list, tuple)):
        items = [_stand_in(tokenizer, item) for item in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def read_checkpoint_template(path: str | Path) -> str | None:
    """A checkpoint's own chat template source, or None when it has none.

    In a folder, `chat_template.jinja` wins over `chat_template` in `tokenizer_config.json` (as in
    transformers); that entry is a string, or a list of `{"name", "template"}` dicts of which "default" is
    taken. A `.gguf` file's template is its `tokenizer.chat_template` metadata.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf_template(path)
    if not path.is_dir():
        raise ChatTemplateError(f"checkpoint {str(path)!r} is neither a folder nor a .gguf file")
    jinja_file = path / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = path / TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ChatTemplateError(f"{config_file}: invalid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{config_file}: expected a JSON object")
    return _template_from_config_entry(config.get("chat_template"), config_file)


def default_template_name(special_tokens: Iterable[str]) -> str:
    """The built-in template for a checkpoint that has none, chosen from its tokenizer's special tokens.

    `llama3` when the vocabulary has `<|start_header_id|>`; `chatml` when it has `<|im_start|>`; `llama2` when
    it has `[INST]`, or `<s>` and `</s>` (a SentencePiece Llama / Mistral vocabulary); `raw` otherwise.
    """
    tokens = set(special_tokens)
    if "<|start_header_id|>" in tokens:
        return "llama3"
    if "<|im_start|>" in tokens:
        return "chatml"
    if "[INST]" in tokens or {"<s>", "</s>"} <= tokens:
        return "llama2"
    return "raw"


def end_of_turn_tokens(template_text: str) -> tuple[str, ...]:
    """The end-of-turn token texts (from `END_OF_TURN_TOKENS`) that a template's source writes."""
    return tuple(token for token in END_OF_TURN_TOKENS if token in template_text)


def _template_from_config_entry(entry: object, config_file: Path) -> str | None:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        for item in entry
    ):
        named = {item["name"]: item["template"] for item in entry}
        if "default" not in named:
            raise ChatTemplateError(
                f"{config_file}: chat_template has no 'default' among {sorted(named)}; "
                "pick one with a template override"
            )
        return named["default"]
    raise ChatTemplateError(f"{config_file}: chat_template must be a string or a list of {{name, template}}")


def _read_gguf_template(path: Path) -> str | None:
    import gguf  # only needed for GGUF checkpoints

    field = gguf.GGUFReader(path).fields.get(GGUF_CHAT_TEMPLATE_KEY)
    return None if field is None else field.contents()


def _builtin_names() -> str:
    return ", ".join(BUILTIN_TEMPLATES)


@lru_cache(maxsize=32)
def _compile(source: str, name: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
        message = f"invalid chat template {name!r}: line {error.lineno}: {error.message}"
        raise ChatTemplateError(message) from error


@lru_cache(maxsize=1)
def _environment() -> BoundedSandbox:
    environment = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without Jinja's HTML escaping, with `json.dumps`' options (transformers' `tojson`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    """The `dict` global: builds dicts without exposing the `dict` type itself to the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The `namespace` global, refusing underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            message = f"chat templates cannot set underscore-prefixed attributes ({name!r})"
            raise jinja2.exceptions.SecurityError(message)


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    plain = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}]: expected a mapping, got {type(message).__name__}")
        plain.append({_plain(key): _plain(value) for key, value in message.items() if value is not None})
    return plain


def _plain(value: Any) -> Any:
    """Rebuild a value from plain JSON-like types, so the template never sees methods of richer objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"
