"""The `jaxllama` command line, checked before anything loads.

`check_argv` reads argv against the command function's signature: an unknown flag, a missing or extra argument, or a
number that is not one is refused with the command's usage and exit status 2, before a model is converted or loaded.
Flags take either spelling (`--max-tokens`, `--max_tokens`), `--flag value` or `--flag=value`; booleans also
`--no-flag`; repeatable flags (`--stop a --stop b`) gather into a list. What passes is handed to fire as
`--name=<Python literal>`, so that fire reads every value exactly as given (a `--system-prompt` of `True` stays text).
Help is written here too, from the signature and the docstring's `Args:` (or, for a flag it leaves out, the help the
commands share), with the flags spelled as the README writes them, and printed without a pager.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Callable, Mapping, Sequence

WIDTH = 110


class UsageError(Exception):
    """A command line the command cannot take, in the user's terms (the flag or argument named)."""


@dataclasses.dataclass(frozen=True)
class Option:
    name: str  # the parameter's
    kind: str  # "bool", "int", "float", "str" or "list" (repeatable)
    positional: bool
    required: bool
    default: object
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def options(fn: Callable, repeatable: Sequence[str] = (), helps: Mapping[str, str] | None = None) -> list[Option]:
    """fn's parameters as command-line options: those before `*` are positional arguments, the rest flags. An option's
    help is fn's docstring's, else that of `helps` (what several commands share)."""
    docs = {**(helps or {}), **_arg_docs(fn.__doc__ or "")}
    out = []
    for p in inspect.signature(fn).parameters.values():
        required = p.default is inspect.Parameter.empty
        out.append(
            Option(
                name=p.name,
                kind=_kind(p, repeatable),
                positional=p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD,
                required=required,
                default=None if required else p.default,
                help=docs.get(p.name, ""),
            )
        )
    return out


def _kind(p: inspect.Parameter, repeatable: Sequence[str]) -> str:
    if p.name in repeatable:
        return "list"
    if isinstance(p.default, bool):
        return "bool"
    annotation = str(p.annotation)  # a string: cli.py uses `from __future__ import annotations`
    return next((k for k in ("int", "float") if annotation.split(" ")[0] == k), "str")


def _arg_docs(doc: str) -> dict[str, str]:
    """{parameter: its text} from a Google-style `Args:` section."""
    docs: dict[str, str] = {}
    lines = inspect.cleandoc(doc).splitlines()
    if "Args:" not in lines:
        return docs
    name = None
    for line in lines[lines.index("Args:") + 1 :]:
        match = re.match(r"^  (\w+): (.*)$", line)
        if match:
            name, docs[match[1]] = match[1], match[2]
        elif line.startswith("    ") and name:
            docs[name] += " " + line.strip()
        elif line.strip():
            break
    return docs


def parse(fn: Callable, argv: Sequence[str], repeatable: Sequence[str] = ()) -> tuple[list[str], dict[str, object]]:
    """argv checked against fn's signature: (positional values, {parameter: value string, "True"/"False" or a list of
    strings}). UsageError names what is wrong."""
    opts = options(fn, repeatable)
    by_flag = {o.flag: o for o in opts} | {"--" + o.name: o for o in opts}
    positional, flags = [], {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            if arg.startswith("-") and len(arg) > 1 and not _is_number(arg):
                raise UsageError(f"unknown flag {arg}")
            positional.append(arg)
            continue
        key, eq, value = arg.partition("=")
        option, value = _match_flag(by_flag, key, eq, value)
        if option.kind != "bool" and not eq:
            if not args or args[0].startswith("--"):
                raise UsageError(f"{option.flag} needs a value")
            value = args.pop(0)
        _check_value(option, value)
        if option.kind == "list":
            flags.setdefault(option.name, []).append(value)
        else:
            flags[option.name] = value
    return _check_positional(opts, positional, flags), flags


def _match_flag(by_flag: dict[str, Option], key: str, eq: str, value: str) -> tuple[Option, str]:
    """The option a flag names, and its value for a boolean one (`--flag`, `--no-flag`, `--flag=false`)."""
    if key in by_flag:
        option = by_flag[key]
        if option.kind == "bool":
            if eq and value.lower() not in ("true", "false", "1", "0"):
                raise UsageError(f"{option.flag}={value}: expected true or false")
            value = str(not eq or value.lower() in ("true", "1"))
        return option, value
    for prefix in ("--no-", "--no_", "--no"):
        negated = by_flag.get("--" + key[len(prefix) :]) if key.startswith(prefix) else None
        if negated is not None and negated.kind == "bool" and not eq:
            return negated, "False"
    raise UsageError(f"unknown flag {key}")


def _check_value(option: Option, value: str) -> None:
    kinds = {"int": (int, "an integer"), "float": (float, "a number")}
    if option.kind in kinds:
        convert, what = kinds[option.kind]
        try:
            convert(value)
        except ValueError:
            raise UsageError(f"{option.flag} {value}: expected {what}") from None


def _check_positional(opts: list[Option], values: list[str], flags: dict) -> list[str]:
    slots = [o for o in opts if o.positional]
    if len(values) > len(slots):
        extra = values[len(slots)]
        raise UsageError(f"unexpected argument {extra!r}")
    for option in slots[len(values) :]:
        if option.required and option.name not in flags:
            raise UsageError(f"missing argument {option.name.upper()}")
    return values


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def fire_argv(fn: Callable, argv: Sequence[str], repeatable: Sequence[str] = ()) -> list[str]:
    """argv as fire should read it: each value a Python literal, so that fire takes it as it was typed."""
    positional, flags = parse(fn, argv, repeatable)
    kinds = {o.name: o.kind for o in options(fn, repeatable)}
    convert = {"int": int, "float": float, "bool": lambda v: v == "True"}
    out = [repr(v) for v in positional]
    for name, value in flags.items():
        out.append(f"--{name}={convert.get(kinds[name], str)(value) if kinds[name] != 'list' else value!r}")
    return out


def unescape(text: str) -> str:
    r"""`\n`, `\t`, `\r`, `\\` and `\uXXXX` read as the characters they stand for (a shell passes them as typed)."""
    chars = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    return re.sub(r"\\(u[0-9a-fA-F]{4}|[ntr\\])", lambda m: chars.get(m[1]) or chr(int(m[1][1:], 16)), text)


# ---- usage and help ---------------------------------------------------------------------------------


def metavar(option: Option, metavars: dict[str, str]) -> str:
    """How usage writes an option's value: its default, else as `metavars` says, else its name in capitals."""
    if option.default is not None and option.kind != "bool":
        return str(option.default)
    return metavars.get(option.name, option.name.upper())


def usage(command: str, fn: Callable, metavars: dict[str, str], repeatable: Sequence[str] = ()) -> list[str]:
    """The command's usage, one item a word: `run`, `JOB.jsonl`, `[--model CKPT]`, `[--stop STR ...]`, ..."""
    items = [command]
    for o in options(fn, repeatable):
        word = metavar(o, metavars)
        if o.positional:
            items.append(word if o.required else f"[{word}]")
        elif o.kind == "bool":
            items.append(f"[{o.flag}]")
        else:
            items.append(f"[{o.flag} {word}{' ...' if o.kind == 'list' else ''}]")
    return items


def wrap(items: Sequence[str], first: str, indent: int) -> str:
    """Items joined by spaces into lines of at most WIDTH characters, breaking only between items."""
    lines, line = [], first
    for item in items:
        if line.strip() and len(line) + 1 + len(item) > WIDTH:
            lines.append(line)
            line = " " * indent + item
        else:
            line += item if line.endswith(" ") or not line else " " + item
    return "\n".join([*lines, line])


def help_text(
    program: str,
    command: str,
    fn: Callable,
    metavars: dict[str, str],
    repeatable=(),
    helps: Mapping[str, str] | None = None,
) -> str:
    items = usage(command, fn, metavars, repeatable)
    head = f"usage: {program}"
    parts = [wrap(items, head, len(head) + len(command) + 2), "", _description(fn)]
    opts = options(fn, repeatable, helps)
    rows = [(metavar(o, metavars), o.help) for o in opts if o.positional]
    if rows:
        parts += ["", "arguments:", *_table(rows)]
    rows = [(f"{o.flag}" + ("" if o.kind == "bool" else f" {metavar(o, metavars)}"), o.help) for o in opts]
    rows = [r for r, o in zip(rows, opts, strict=True) if not o.positional] + [("-h, --help", "this help")]
    parts += ["", "options:", *_table(rows)]
    return "\n".join(parts) + "\n"


def _description(fn: Callable) -> str:
    doc = inspect.cleandoc(fn.__doc__ or "")
    return doc.split("\nArgs:")[0].strip()


def _summary(fn: Callable) -> str:
    """The docstring's first sentence, or what precedes its first colon."""
    first = " ".join(_description(fn).split("\n\n")[0].split())
    return re.split(r"[.:] ", first + " ", maxsplit=1)[0]


def _table(rows: list[tuple[str, str]]) -> list[str]:
    width = min(28, max(len(left) for left, _ in rows) + 2)
    out = []
    for left, right in rows:
        pad = f"  {left}".ljust(width + 2)
        if len(pad) > width + 2:
            out.append(f"  {left}")
            pad = " " * (width + 2)
        out.append(wrap(right.split(), pad, width + 2))
    return out


def top_help(program: str, commands: dict[str, Callable]) -> str:
    rows = [(name, _summary(fn)) for name, fn in commands.items()]
    rows += [("--version", "print the version"), ("-h, --help", "this help")]
    lines = [f"usage: {program} COMMAND [ARGS]   ({program} COMMAND --help: its arguments and flags)", ""]
    return "\n".join([*lines, "commands:", *_table(rows)]) + "\n"


def check_argv(
    program: str,
    commands: dict[str, Callable],
    argv: Sequence[str],
    *,
    version: str,
    metavars: dict[str, str],
    repeatable: Sequence[str] = (),
    helps: Mapping[str, str] | None = None,
) -> list[str]:
    """fire's command line for argv (the command's name, then its arguments as `fire_argv` writes them); or the help
    or the version printed (exit 0), or the usage and what was wrong (exit 2). `helps`: the help of flags that several
    commands share, for those a command's docstring leaves out."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        _exit(top_help(program, commands), 0 if argv else 2)
    if argv[0] in ("--version", "-V"):
        _exit(f"{program} {version}\n", 0)
    command, args = argv[0], argv[1:]
    if command not in commands:
        _exit(f"{top_help(program, commands)}\nerror: unknown command {command!r}\n", 2)
    fn = commands[command]
    if any(a in ("-h", "--help") for a in args):
        _exit(help_text(program, command, fn, metavars, repeatable, helps), 0)
    try:
        return [command, *fire_argv(fn, args, repeatable)]
    except UsageError as e:
        head = f"usage: {program}"
        text = wrap(usage(command, fn, metavars, repeatable), head, len(head) + len(command) + 2)
        _exit(f"{text}\n({program} {command} --help for more)\nerror: {e}\n", 2)


def _exit(text: str, status: int):
    (sys.stdout if status == 0 else sys.stderr).write(text)
    sys.exit(status)
