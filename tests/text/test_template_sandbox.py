"""Chat templates are untrusted code: rendering one is bounded in work, time and size, and a template over its
budget fails with a ChatTemplateError (a TemplateError: a 400 "template_error" for a request) naming the limit."""

from __future__ import annotations

import threading

import pytest

from jaxllama.errors import TemplateError
from jaxllama.protocol import errors
from jaxllama.text.builtin_templates import BUILTIN_TEMPLATES
from jaxllama.text.chat_template import ChatTemplate, ChatTemplateError
from jaxllama.text.template_sandbox import (
    MAX_CHARS,
    MAX_STEPS,
    BoundedSandbox,
    RenderBudget,
    RenderLimitExceeded,
    render_bounded,
)

MESSAGES = [{"role": "user", "content": "hello"}]

BOMBS = {
    "nested_range": ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "steps"),
    "nested_loops_over_text": (
        "{% set s = 'ab' * 50000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "string_repeat": ("{{ 'x' * 10 ** 10 }}", "characters"),
    "list_repeat": ("{% for m in messages * 10 ** 8 %}{% endfor %}", "items"),
    "big_power": ("{{ 2 ** (10 ** 9) }}", "bits"),
    "center_filter": ("{{ 'x' | center(10 ** 10) }}", "characters"),
    "center_method": ("{{ 'x'.center(10 ** 10) }}", "characters"),
    "printf_width": ("{{ '%999999999999d' % 1 }}", "characters"),
    "format_width": ("{{ '{:>999999999999}'.format(1) }}", "characters"),
    "replace_empty": ("{{ ('x' * 10000).replace('', 'y' * 10000) }}", "characters"),
    "concat_doubling": (
        "{% macro grow(s, n) %}{% if n %}{{ grow(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ grow('x', 40) }}",
        "characters",
    ),
    "namespace_doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "characters",
    ),
    "output_flood": ("{% for i in range(100) %}{{ 'x' * 10 ** 6 }}{% endfor %}", "output"),
}


def render_or_give_up(template: ChatTemplate, timeout: float = 60) -> BaseException | None:
    """What rendering `template` raised (None if nothing), failing the test if it still runs after `timeout`
    seconds (on a daemon thread, left behind)."""
    raised = []

    def render() -> None:
        try:
            template.render(MESSAGES)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            raised.append(e)

    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"rendering still runs after {timeout} s"
    return raised[0] if raised else None


@pytest.mark.parametrize("bomb", BOMBS)
def test_a_template_over_budget_is_stopped_with_a_template_error(bomb: str) -> None:
    source, limit = BOMBS[bomb]
    error = render_or_give_up(ChatTemplate(source, name="bomb"))
    assert isinstance(error, ChatTemplateError) and isinstance(error, TemplateError), repr(error)
    assert "chat template 'bomb'" in str(error) and limit in str(error)
    failure = errors.failure(error, "chat")
    assert (failure.status, failure.code, failure.param) == (400, "template_error", "messages")


def test_a_template_that_runs_out_of_time_is_stopped() -> None:
    slow = "{% for i in range(1000) %}{{ ('x' * 10 ** 6) | replace('x', 'yy') | length }}{% endfor %}"
    budget = RenderBudget(max_seconds=0.2)  # the steps it takes are far under the budget's
    with pytest.raises(RenderLimitExceeded, match=r"more than 0.2 s"):
        render_bounded(BoundedSandbox().from_string(slow), {}, budget)
    assert budget.steps < budget.max_steps // 100


def test_template_failures_are_template_errors() -> None:
    for source in ["{{ 1 / 0 }}", "{{ range(1, 2, 0) }}", "{{ 10.0 ** 1000 }}", "{{ '{:d}'.format('x') }}"]:
        with pytest.raises(ChatTemplateError, match="failed to render"):
            ChatTemplate(source).render(MESSAGES)


def test_long_conversations_and_big_contents_render() -> None:
    conversation = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " * 10} for i in range(5000)]
    text = ChatTemplate.builtin("llama3").render(conversation, bos_token="<|begin_of_text|>")
    assert text.count("<|eot_id|>") == 5000
    big = [{"role": "user", "content": "x" * (MAX_CHARS // 4)}]
    assert len(ChatTemplate.builtin("chatml").render(big)) > MAX_CHARS // 4
    assert (
        ChatTemplate("{% for i in range(100) %}{% for j in range(100) %}.{% endfor %}{% endfor %}").render(MESSAGES)
        == "." * 10_000
    )


def test_each_rendering_has_its_own_budget() -> None:
    """Renderings one after another, or at once on several threads, do not share steps."""
    source = "{% for i in range(N) %}{% endfor %}ok".replace("N", str(MAX_STEPS // 3))
    template = ChatTemplate(source)
    assert [template.render(MESSAGES) for _ in range(4)] == ["ok"] * 4
    results = []
    threads = [threading.Thread(target=lambda: results.append(template.render(MESSAGES))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["ok"] * 4


@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_builtin_templates_render_within_budget(name: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, *MESSAGES]
    assert ChatTemplate.builtin(name).render(messages, bos_token="<s>", eos_token="</s>")
