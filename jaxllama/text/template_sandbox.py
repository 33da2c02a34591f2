"""A Jinja sandbox with a budget: chat templates are untrusted code, and a sandbox that keeps them from reaching
Python's internals still lets them loop for hours or build gigabyte strings (`range(100000)` nested twice,
`'x' * 10**10`, `2 ** (10 ** 9)`). `render_bounded` renders a template under a `RenderBudget`:

- work: every loop iteration, call and `range` element spends from `max_steps`, and the clock is read at
  each spend (`max_seconds`);
- size: no string a template builds (with `*`, `+`, `~`, `%`, a filter or a method) nor the output may exceed
  `max_chars`, no list `max_items`; integers may not exceed `MAX_INT_BITS` bits.

Going over raises `RenderLimitExceeded` (a `jaxllama.errors.TemplateError`) naming the limit.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor

from jaxllama import errors

MAX_STEPS = 1_000_000
"""Loop iterations, calls and `range` elements a rendering may spend: legitimate templates spend a few per
message (tens of thousands for the longest conversations)."""
MAX_SECONDS = 5.0
MAX_CHARS = 64 * 2**20
"""Characters of any string a template builds, and of its output: room for requests of several megabytes
rendered more than once."""
MAX_ITEMS = 1_000_000
"""Items of any list a template builds: no more than it could loop over."""
MAX_INT_BITS = 4096

# String methods and filters whose result can be far larger than their input, by a width argument: checked
# before they run (see `_precheck`).
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "indent", "wordwrap"})
# A printf-style or str.format field; the numbers in it are widths, precisions or indexes.
_FORMAT_FIELD = re.compile(r"%[-+ #0-9.*]*|\{[^{}]*\}")
_DIGITS = re.compile(r"\d+")


class RenderLimitExceeded(errors.TemplateError):
    """A template spent more work, time or memory than its `RenderBudget` allows."""


@dataclasses.dataclass
class RenderBudget:
    """What one rendering may spend (see the module docstring)."""

    max_steps: int = MAX_STEPS
    max_seconds: float = MAX_SECONDS
    max_chars: int = MAX_CHARS
    max_items: int = MAX_ITEMS
    steps: int = 0
    deadline: float = dataclasses.field(default=0.0, repr=False)

    def spend(self, steps: int, what: str) -> None:
        self.steps += steps
        if self.steps > self.max_steps:
            raise RenderLimitExceeded(f"rendering took more than {self.max_steps:,} steps ({what})")
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded(f"rendering took more than {self.max_seconds:g} s ({what})")

    def check_size(self, value: Any, what: str) -> Any:
        """`value`, unless it is a string or list longer than allowed, or an integer too large."""
        if isinstance(value, (str, list, tuple)):
            self.check_planned(len(value), what, type(value), done=True)
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise RenderLimitExceeded(f"{what} built an integer of more than {MAX_INT_BITS} bits")
        return value

    def check_planned(self, size: int, what: str, kind: type = str, *, done: bool = False) -> None:
        """Refuse an operation that would build a `kind` (str, list or tuple) of `size` items, before it runs."""
        limit, unit = (self.max_chars, "characters") if issubclass(kind, str) else (self.max_items, "items")
        if size > limit:
            built = "built" if done else "would build"
            raise RenderLimitExceeded(f"{what} {built} a {kind.__name__} of {size:,} {unit} (at most {limit:,})")


_BUDGET: ContextVar[RenderBudget | None] = ContextVar("jaxllama_template_budget", default=None)


def render_bounded(template: jinja2.Template, variables: Mapping[str, Any], budget: RenderBudget | None = None) -> str:
    """Render `template` (compiled by a `BoundedSandbox`) within `budget` (default: the module's limits).

    The budget lives in a context variable, so renderings on different threads each have their own.
    """
    budget = budget or RenderBudget()
    budget.deadline = time.monotonic() + budget.max_seconds
    token = _BUDGET.set(budget)
    try:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > budget.max_chars:
                raise RenderLimitExceeded(f"the output is longer than {budget.max_chars:,} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _BUDGET.reset(token)


def _budget() -> RenderBudget:
    budget = _BUDGET.get()
    return budget if budget is not None else RenderBudget(max_seconds=float("inf"), deadline=float("inf"))


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, where every loop, call, `range`, filter and size-growing operator is charged
    to the budget of the current `render_bounded`."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **options: Any):
        extensions = [*options.pop("extensions", ()), _BudgetHooks]
        super().__init__(extensions=extensions, **options)
        self.globals["range"] = _range
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        return _ChargeLoopsAndConcats(self.extensions[_BudgetHooks.identifier]).visit(tree)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's signature
        budget = _budget()
        budget.spend(1, "a call")
        # A str method, or the sandbox's wrapper of `str.format` (which keeps the method as `__wrapped__`).
        receiver = getattr(__obj, "__self__", None) or getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
        if isinstance(receiver, str):
            _precheck(budget, getattr(__obj, "__name__", ""), receiver, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.check_size(result, "a call")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        what = f"the operator {operator!r}"
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and errors.is_int(times):
                    budget.check_planned(len(sequence) * times, what, type(sequence))
        elif operator == "**" and errors.is_int(left) and errors.is_int(right) and abs(left) > 1:
            if right * abs(left).bit_length() > MAX_INT_BITS:
                raise RenderLimitExceeded(f"{what} would build an integer of more than {MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_widths(budget, left, what)
        return budget.check_size(super().call_binop(context, operator, left, right), what)


class _BudgetHooks(jinja2.ext.Extension):
    """The functions the rewritten template calls: `_iterate` around every for loop's iterable, `_built` around
    every `~` concatenation."""

    def _iterate(self, iterable: Iterable) -> Iterator:
        budget = _budget()
        for item in iterable:
            budget.spend(1, "a loop")
            yield item

    def _built(self, value: Any) -> Any:
        return _budget().check_size(value, "the operator '~'")


class _ChargeLoopsAndConcats(jinja2.visitor.NodeTransformer):
    def __init__(self, hooks: _BudgetHooks):
        self.hooks = hooks

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.For:
        self.generic_visit(node)
        node.iter = self.hooks.call_method("_iterate", [node.iter], lineno=node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Call:
        self.generic_visit(node)
        return self.hooks.call_method("_built", [node], lineno=node.lineno)


def _range(*args: int) -> range:
    """`range`, its length charged (in place of jinja2's fixed cap of 100,000)."""
    numbers = range(*args)
    _budget().spend(len(numbers), "range")
    return numbers


def _bounded_filter(name: str, function):
    """`function` (a filter) charged one step, with its arguments and result checked."""

    @functools.wraps(function)  # keeps jinja2's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.spend(1, f"the filter {name!r}")
        values = [a for a in args if not isinstance(a, _PASSED)]
        if values and isinstance(values[0], str):
            _precheck(budget, name, values[0], tuple(values[1:]), kwargs)
        return budget.check_size(function(*args, **kwargs), f"the filter {name!r}")

    return bounded


_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)  # what pass_* filters get first


def _precheck(budget: RenderBudget, name: str, text: str, args: tuple, kwargs: Mapping) -> None:
    """Refuse a string method or filter `name` on `text` whose result would be too large."""
    what = f"{name!r}"
    numbers = [v for v in (*args, *kwargs.values()) if errors.is_int(v)]
    if name in _WIDTH_METHODS:
        width = max(numbers, default=0)
        lines = text.count("\n") + 1 if name == "indent" else 1
        budget.check_planned(len(text) + width * lines, what)
    elif name == "expandtabs":
        budget.check_planned(len(text) * max(numbers, default=8), what)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[:2]
        budget.check_planned(len(text) + (text.count(old) if old else len(text) + 1) * len(new), what)
    elif name in ("format", "format_map"):
        _check_widths(budget, text, what)


def _check_widths(budget: RenderBudget, fmt: str, what: str) -> None:
    """Refuse a format string with a field width or precision larger than the budget's size."""
    for field in _FORMAT_FIELD.findall(fmt):
        for digits in _DIGITS.findall(field):
            budget.check_planned(int(digits[:12]) if len(digits) <= 12 else budget.max_chars + 1, what)
