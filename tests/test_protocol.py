"""Reading OpenAI request bodies (`jaxllama.protocol.requests`): what the batch runner and the server accept."""

from __future__ import annotations

import pytest

from jaxllama.engine.request import SamplingParams
from jaxllama.protocol.requests import RequestError, output_options, parse_body, submit_error
from jaxllama.text.chat_template import ChatTemplateError

DEFAULTS = SamplingParams(max_tokens=50, temperature=0.5)
HI = [{"role": "user", "content": "hi"}]


def test_fields_override_the_defaults():
    body = {
        "messages": HI,
        "max_completion_tokens": 7,
        "top_k": 3,
        "seed": 1,
        "stop": "\n",
        "stop_token_ids": [5],
        "model": "m",
        "user": "ignored",
    }
    parsed = parse_body(body, "chat", DEFAULTS)
    assert parsed.params == SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=1, stop_token_ids=(5,))
    assert parsed.stop == ["\n"] and parsed.model == "m" and parsed.messages == HI and parsed.prompt is None
    assert parse_body({"prompt": "x", "temperature": None}, "completion", DEFAULTS, ["END"]).params == DEFAULTS
    assert parse_body({"prompt": "x"}, "completion", DEFAULTS, ["END"]).stop == ["END"]
    assert parse_body({"prompt": ["x"]}, "completion", DEFAULTS).prompt == "x"


@pytest.mark.parametrize(
    "body, kind, code, param",
    [
        ({"messages": HI, "top_p": 0}, "chat", "invalid_parameter", "top_p"),
        ({"messages": HI, "max_completion_tokens": 0}, "chat", "invalid_parameter", "max_completion_tokens"),
        ({"messages": HI, "temperature": True}, "chat", "invalid_parameter", "temperature"),
        ({"messages": HI, "stop_token_ids": [1.5]}, "chat", "invalid_parameter", "stop_token_ids"),
        ({"messages": HI, "stop": ["a", 3]}, "chat", "invalid_parameter", "stop"),
        ({"messages": HI, "n": 3}, "chat", "invalid_parameter", "n"),
        ({"messages": HI, "logit_bias": {"1": 5}}, "chat", "invalid_parameter", "logit_bias"),
        ({"messages": [{"role": "user"}]}, "chat", "invalid_messages", "messages"),
        ({"prompt": ["a", "b"]}, "completion", "invalid_request", "prompt"),
        ({"prompt": "x", "echo": True}, "completion", "invalid_parameter", "echo"),
        ({"prompt": "x", "best_of": 2}, "completion", "invalid_parameter", "best_of"),
    ],
)
def test_bad_bodies_name_the_field(body, kind, code, param):
    with pytest.raises(RequestError) as e:
        parse_body(body, kind, DEFAULTS)
    assert (e.value.code, e.value.param) == (code, param) and e.value.message.startswith(param)


def test_off_values_of_unsupported_fields_are_accepted():
    body = {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "suffix": "", "logit_bias": {}, "tools": []}
    assert parse_body(body, "completion", DEFAULTS).prompt == "x"


def test_output_options():
    assert output_options({}, "chat") == output_options({"stream": False}, "completion")
    options = output_options({"stream": True, "stream_options": {"include_usage": True}, "logprobs": True}, "chat")
    assert (options.stream, options.include_usage, options.logprobs) == (True, True, True)
    assert output_options({"logprobs": 0}, "completion").logprobs
    assert not output_options({"logprobs": None}, "completion").logprobs
    for body, kind, param in [
        ({"stream": "yes"}, "chat", "stream"),
        ({"stream_options": {"include_usage": True}}, "chat", "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "chat", "stream_options.include_usage"),
        ({"logprobs": True, "top_logprobs": 1}, "chat", "top_logprobs"),
        ({"logprobs": 2}, "completion", "logprobs"),
        ({"logprobs": True}, "completion", "logprobs"),
    ]:
        with pytest.raises(RequestError) as e:
            output_options(body, kind)
        assert e.value.param == param


def test_submit_errors():
    long = submit_error(ValueError("prompt is 300 tokens, the context limit is 256 (...)"), "completion")
    assert (long.code, long.param) == ("context_length_exceeded", "prompt")
    template = submit_error(ChatTemplateError("the template failed"), "chat")
    assert (template.code, template.param) == ("template_error", "messages")
    field = submit_error(ValueError("stop_token_ids=[999]: 999 is outside the vocabulary"), "chat")
    assert (field.code, field.param) == ("invalid_parameter", "stop_token_ids")
    assert submit_error(ValueError("stop strings must not be empty"), "chat").param == "stop"
    assert submit_error(ValueError("prompt is empty"), "completion").code == "invalid_request"
