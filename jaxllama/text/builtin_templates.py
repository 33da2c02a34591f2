"""Built-in chat templates, selectable by name when a checkpoint has none or the user overrides it.

Each is Jinja source rendered by `jaxllama.text.chat_template.ChatTemplate` with the same variables as any
checkpoint template (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, ...).
"""

from __future__ import annotations

from types import MappingProxyType

LLAMA2 = (
    r"{% if messages[0]['role'] == 'system' %}"
    r"{% set system_prompt = messages[0]['content'] %}{% set turns = messages[1:] %}"
    r"{% else %}"
    r"{% set system_prompt = none %}{% set turns = messages %}"
    r"{% endif %}"
    r"{% for message in turns %}"
    r"{% if message['role'] not in ('user', 'assistant') %}"
    r"{{ raise_exception('llama2 template: only system, user and assistant messages are supported.') }}"
    r"{% endif %}"
    r"{% if (message['role'] == 'user') != (loop.index0 is even) %}"
    r"{{ raise_exception('llama2 template: need user and assistant messages to alternate (user first).') }}"
    r"{% endif %}"
    r"{% set content = message['content'] %}"
    r"{% if loop.first and system_prompt is not none %}"
    r"{% set content = '<<SYS>>\n' + system_prompt + '\n<</SYS>>\n\n' + content %}"
    r"{% endif %}"
    r"{% if message['role'] == 'user' %}"
    r"{{ bos_token + '[INST] ' + (content | trim) + ' [/INST]' }}"
    r"{% else %}"
    r"{{ ' ' + (content | trim) + ' ' + eos_token }}"
    r"{% endif %}"
    r"{% endfor %}"
)
"""Llama 2 chat, as Meta's `chat_completion` builds it: every user turn opens with BOS and `[INST]`, the
system prompt is folded into the first user turn inside `<<SYS>>`, and each answer ends with EOS.
`add_generation_prompt` has no effect: the prompt already ends with `[/INST]`."""

LLAMA3 = (
    r"{{ bos_token }}"
    r"{% for message in messages %}"
    r"{{ '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role']) }}"
    r"{{ '<|end_header_id|>\n\n' + message['content'] }}"
    r"{% if message['role'] == 'assistant' and message['stop_reason'] == 'end_of_message' %}"
    r"{{ '<|eom_id|>' }}"
    r"{% else %}"
    r"{{ '<|eot_id|>' }}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}"
    r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    r"{% endif %}"
)
"""Llama 3 headers exactly as Meta's `ChatFormat.encode_dialog_prompt` writes them: contents are not trimmed,
the `tool` role is written as `ipython`, and an assistant message with `stop_reason: "end_of_message"` ends
with `<|eom_id|>` instead of `<|eot_id|>`."""

CHATML = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}"
    r"{{ '<|im_start|>assistant\n' }}"
    r"{% endif %}"
)
"""ChatML (`<|im_start|>role\\n...<|im_end|>`), with no default system prompt."""

RAW = r"{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""No chat format: the messages' contents concatenated as they are, so a single message is a plain prompt."""

BUILTIN_TEMPLATES: MappingProxyType[str, str] = MappingProxyType(
    {"llama2": LLAMA2, "llama3": LLAMA3, "chatml": CHATML, "raw": RAW}
)
"""Built-in template sources by name."""
