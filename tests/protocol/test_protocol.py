"""Reading OpenAI request bodies (`jaxllama.protocol.requests`, `.pipeline`) and answering failures
(`jaxllama.protocol.errors`): what the batch runner and the server accept, and the codes they refuse with."""

from __future__ import annotations

import json

import pytest

from jaxllama import errors as E
from jaxllama.engine.request import SamplingParams, Timings
from jaxllama.protocol import errors, responses
from jaxllama.protocol.logprobs import answer_logprobs
from jaxllama.protocol.pipeline import RequestPipeline
from jaxllama.protocol.requests import REQUEST_FIELDS, SAMPLING_FIELDS, output_options, parse_body, sampling_params
from jaxllama.results import Result
from jaxllama.text.chat_template import ChatTemplate, ChatTemplateError
from jaxllama.text.conversation import ConversationError
from jaxllama.text.structured import OutputFormat
from tests.helpers.protocol import Characters

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
    assert parsed.stop == ["\n"] and parsed.model == "m" and parsed.messages == HI and parsed.prompts is None
    assert parse_body({"prompt": "x", "temperature": None}, "completion", DEFAULTS, ["END"]).params == DEFAULTS
    assert parse_body({"prompt": "x"}, "completion", DEFAULTS, ["END"]).stop == ["END"]
    assert parse_body({"prompt": ["x"]}, "completion", DEFAULTS).prompts == ["x"]
    assert parse_body({"prompt": [1, 2]}, "completion", DEFAULTS).prompts == [[1, 2]]
    assert parse_body({"prompt": ["x", [3]]}, "completion", DEFAULTS).prompts == ["x", [3]]


def test_the_sampling_fields_are_those_of_sampling_params():
    assert set(REQUEST_FIELDS.values()) == set(SAMPLING_FIELDS) == {f for f in SamplingParams.__dataclass_fields__}
    every = {"max_tokens": 9, "temperature": 0.0, "top_k": 4, "top_p": 0.5, "min_p": 0.1, "seed": 2}
    every |= {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "stop_token_ids": [3]}
    every |= {"min_tokens": 2, "ignore_eos": True, "logit_bias": {"7": -100, "3": 2.5}}
    every |= {"top_logprobs": 3, "prompt_logprobs": 1}
    assert set(every) == set(SAMPLING_FIELDS)
    expected = {**every, "stop_token_ids": (3,), "logit_bias": ((3, 2.5), (7, -100.0))}
    assert sampling_params(every, DEFAULTS) == SamplingParams(**expected)
    assert sampling_params({"max_tokens": 3, "max_completion_tokens": 4}, DEFAULTS).max_tokens == 4  # the later wins


@pytest.mark.parametrize(
    "body, kind, code, param",
    [
        ({"messages": HI, "top_p": 0}, "chat", "invalid_parameter", "top_p"),
        ({"messages": HI, "max_completion_tokens": 0}, "chat", "invalid_parameter", "max_completion_tokens"),
        ({"messages": HI, "temperature": True}, "chat", "invalid_parameter", "temperature"),
        ({"messages": HI, "stop_token_ids": [1.5]}, "chat", "invalid_parameter", "stop_token_ids"),
        ({"messages": HI, "stop": ["a", 3]}, "chat", "invalid_parameter", "stop"),
        ({"messages": HI, "n": 0}, "chat", "invalid_parameter", "n"),
        ({"messages": HI, "n": 1000}, "chat", "invalid_parameter", "n"),
        ({"messages": HI, "ignore_eos": 1}, "chat", "invalid_parameter", "ignore_eos"),
        ({"messages": HI, "max_tokens": 4, "min_tokens": 5}, "chat", "invalid_parameter", "min_tokens"),
        ({"messages": HI, "logit_bias": {"1": 101}}, "chat", "invalid_parameter", "logit_bias"),
        ({"messages": HI, "logit_bias": {"one": 1}}, "chat", "invalid_parameter", "logit_bias"),
        ({"messages": HI, "logit_bias": {"\u0663": 1}}, "chat", "invalid_parameter", "logit_bias"),  # Arabic-Indic 3
        ({"messages": HI, "logit_bias": {"1_0": 1}}, "chat", "invalid_parameter", "logit_bias"),
        ({"messages": HI, "logit_bias": {" 5 ": 1}}, "chat", "invalid_parameter", "logit_bias"),
        ({"messages": HI, "logit_bias": {str(i): 1 for i in range(301)}}, "chat", "invalid_parameter", "logit_bias"),
        ({"messages": HI, "response_format": {"type": "xml"}}, "chat", "invalid_parameter", "response_format"),
        ({"messages": HI, "response_format": {"type": "json_schema"}}, "chat", "invalid_parameter", "response_format"),
        ({"messages": HI, "guided_regex": "a", "guided_json": {}}, "chat", "invalid_parameter", "guided_regex"),
        ({"messages": HI, "guided_grammar": 3}, "chat", "invalid_parameter", "guided_grammar"),
        ({"messages": [{"role": "user"}]}, "chat", "invalid_messages", "messages"),
        ({"prompt": ["a", 3]}, "completion", "invalid_request", "prompt"),
        ({"prompt": [[1, 2], []]}, "completion", "invalid_request", "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "completion", "invalid_parameter", "max_tokens"),
        ({"prompt": "x", "echo": 1}, "completion", "invalid_parameter", "echo"),
        ({"prompt": "x", "best_of": 2}, "completion", "invalid_parameter", "best_of"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "completion", "invalid_parameter", "best_of"),
        # A lone surrogate (JSON's "\\udc00") is not text: no tokenizer takes it.
        ({"messages": [{"role": "user", "content": "a\udc00"}]}, "chat", "invalid_request", "messages"),
        ({"prompt": "\ud800"}, "completion", "invalid_request", "prompt"),
        ({"prompt": "x", "stop": ["\udfff"]}, "completion", "invalid_request", "stop"),
    ],
)
def test_bad_bodies_name_the_field(body, kind, code, param):
    with pytest.raises(E.RequestError) as e:
        parse_body(body, kind, DEFAULTS)
    failure = errors.failure(e.value, kind)
    assert (failure.code, failure.status, failure.param) == (code, 400, param)
    assert failure.message == e.value.message and e.value.message.startswith(param)
    assert failure.body()["error"] == {"message": e.value.message, "type": "invalid_request_error"} | {
        "param": param,
        "code": code,
    }


def test_off_values_of_unsupported_fields_are_accepted():
    body = {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "suffix": "", "logit_bias": {}, "tools": []}
    assert parse_body(body, "completion", DEFAULTS).prompts == ["x"]


def test_output_options():
    assert output_options({}, "chat") == output_options({"stream": False}, "completion")
    options = output_options({"stream": True, "stream_options": {"include_usage": True}, "logprobs": True}, "chat")
    assert (options.stream, options.include_usage, options.logprobs) == (True, True, True)
    assert output_options({"logprobs": 0}, "completion").logprobs
    assert not output_options({"logprobs": None}, "completion").logprobs
    # The log-probabilities asked for, as the engine computes them: alternatives, and the prompt's with echo.
    chat = parse_body({"messages": HI, "logprobs": True, "top_logprobs": 3}, "chat", DEFAULTS).params
    assert (chat.top_logprobs, chat.prompt_logprobs) == (3, None)
    echo = parse_body({"prompt": "x", "logprobs": 2, "echo": True, "max_tokens": 0}, "completion", DEFAULTS).params
    assert (echo.top_logprobs, echo.prompt_logprobs, echo.max_tokens) == (2, 2, 0)
    plain = parse_body({"prompt": "x", "echo": True, "top_logprobs": 5, "prompt_logprobs": 1}, "completion", DEFAULTS)
    assert (plain.params.top_logprobs, plain.params.prompt_logprobs) == (0, None)  # no log-probabilities asked
    for body, kind, param in [
        ({"stream": "yes"}, "chat", "stream"),
        ({"stream_options": {"include_usage": True}}, "chat", "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "chat", "stream_options.include_usage"),
        ({"top_logprobs": 1}, "chat", "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "chat", "top_logprobs"),
        ({"logprobs": 21}, "completion", "logprobs"),
        ({"logprobs": True}, "completion", "logprobs"),
        ({"echo": "yes"}, "completion", "echo"),
    ]:
        with pytest.raises(E.InvalidParameter) as e:
            output_options(body, kind)
        assert e.value.param == param


# ---- the error table ---------------------------------------------------------------------------------------

CODES = [
    (E.RequestError, "invalid_request", 400),
    (E.InvalidRequest, "invalid_request", 400),
    (E.InvalidJSON, "invalid_json", 400),
    (E.InvalidParameter, "invalid_parameter", 400),
    (E.InvalidMessages, "invalid_messages", 400),
    (E.TemplateError, "template_error", 400),
    (E.ContextLengthExceeded, "context_length_exceeded", 400),
    (E.DuplicateId, "duplicate_id", 400),
    (E.UnsupportedEndpoint, "invalid_url", 400),
    (E.QueueFull, "queue_full", 429),
    (E.EngineUnavailable, "engine_unavailable", 503),
    (E.ReplicaLost, "replica_lost", 503),
    (E.ClientClosed, "client_closed", 499),
    (E.CheckpointError, "model_error", 503),
    (E.ModelTooLarge, "model_too_large", 503),
    (E.InvalidOption, "invalid_option", 503),
    (ValueError, "invalid_request", 400),  # a check of the engine's without a class of its own
    (KeyError, "internal_error", 500),
]


def test_every_error_class_has_its_code_and_status():
    classes = [c for c in vars(E).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert set(classes) <= {c for c, _, _ in CODES}  # a new class must be added to the table and here
    for cls, code, status in CODES:
        error = cls("max_slots", 0, "what went wrong") if cls is E.InvalidOption else cls("what went wrong")
        failure = errors.failure(error, "completion")
        assert (failure.code, failure.status) == (code, status), cls
        if status == 500:
            assert (
                failure.kind.type == "server_error" and failure.message == "internal error: KeyError('what went wrong')"
            )
        else:
            assert failure.message == str(error)
    assert errors.failure(E.QueueFull("busy")).kind.type == "rate_limit_error"
    assert errors.internal_failure(E.InvalidParameter("x")).status == 500  # what nothing expected, whatever its class


def test_the_class_decides_the_code_not_the_message():
    for message in ["prompt is 300 tokens, the context limit is 256", "too long", "top_p=2: must be in (0, 1]"]:
        assert errors.failure(E.ContextLengthExceeded(message), "chat").code == "context_length_exceeded"
    assert (
        errors.failure(ValueError("prompt is 300 tokens, the context limit is 256"), "chat").code == "invalid_request"
    )
    assert errors.failure(ValueError("top_p=2: must be in (0, 1]"), "chat").param is None


def test_the_params_of_failures():
    long = E.ContextLengthExceeded("prompt is 300 tokens, the context limit is 256")
    assert errors.failure(long, "completion").param == "prompt" and errors.failure(long, "chat").param == "messages"
    assert errors.failure(E.ContextLengthExceeded("x", "max_tokens"), "chat").param == "max_tokens"
    template = errors.failure(ChatTemplateError("the template failed"), "chat")
    assert (template.code, template.param) == ("template_error", "messages")
    conversation = errors.failure(ConversationError("messages[0].role: missing"), "chat")
    assert (conversation.code, conversation.param) == ("invalid_messages", "messages")
    field = errors.failure(E.InvalidParameter("stop_token_ids=[999]: 999 is outside the vocabulary", "stop_token_ids"))
    assert (field.code, field.param) == ("invalid_parameter", "stop_token_ids")
    assert errors.failure(E.InvalidRequest("prompt is empty"), "completion").param is None


def test_the_text_layer_raises_request_errors():
    assert issubclass(ConversationError, E.InvalidMessages) and issubclass(ChatTemplateError, E.TemplateError)
    with pytest.raises(E.TemplateError) as e:
        ChatTemplate("{{ raise_exception('no system messages') }}").render(HI)
    assert errors.failure(e.value, "chat").code == "template_error"


# ---- the pipeline ------------------------------------------------------------------------------------------


def test_the_pipeline_prepares_a_request():
    pipeline = RequestPipeline(Characters(), DEFAULTS, ("END",))
    body = {"prompt": "ab", "max_tokens": 3, "stream": True, "logprobs": 0, "model": "m"}
    request = pipeline.prepare(body, "completion")
    assert (request.kind, request.prompt, request.stop, request.model) == ("completion", [97, 98], ["END"], "m")
    assert request.params == SamplingParams(max_tokens=3, temperature=0.5)
    assert request.options.stream and request.options.logprobs
    chat = pipeline.prepare({"messages": HI, "stop": None}, "chat")
    assert chat.prompt == Characters().encode("uhi") and chat.stop == [] and chat.params == DEFAULTS


def test_a_job_pipeline_adds_the_system_prompt_and_answers_one_prompt_whole():
    """Job lines are answered whole, a record each: streaming them means nothing, and a line of several prompts is
    refused; log-probabilities and token-id prompts are taken as the server takes them."""
    pipeline = RequestPipeline(Characters(), DEFAULTS, system_prompt="S", output_options=False)
    request = pipeline.prepare({"messages": HI, "stream": True}, "chat")
    assert request.prompt == Characters().encode("sSuhi") and not request.options.stream
    system = [{"role": "system", "content": "T"}, *HI]
    assert pipeline.prepare({"messages": system}, "chat").prompt == Characters().encode("sTuhi")
    echo = pipeline.prepare({"prompt": [104, 105], "echo": True, "logprobs": 1, "max_tokens": 0}, "completion")
    assert echo.prompts == [[104, 105]] and echo.texts == ["hi"] and echo.options.logprobs
    assert (echo.params.prompt_logprobs, echo.params.top_logprobs, echo.params.max_tokens) == (1, 1, 0)
    with pytest.raises(E.InvalidRequest) as e:
        pipeline.prepare({"prompt": ["a", "b"]}, "completion")
    assert e.value.param == "prompt"
    with pytest.raises(E.InvalidParameter):  # checked as the server checks it
        pipeline.prepare({"messages": HI, "stream": "yes"}, "chat")


def test_output_formats_are_read_from_each_field():
    def output(body):
        return parse_body({"prompt": "x", **body}, "completion", DEFAULTS).output

    assert output({}) is None and output({"response_format": {"type": "text"}}) is None
    assert output({"response_format": {"type": "json_object"}}) == OutputFormat("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert output({"response_format": spec}) == OutputFormat("json_schema", schema)
    assert output({"guided_json": json.dumps(schema)}) == OutputFormat("json_schema", schema, "guided_json")
    assert output({"guided_regex": "[a-z]+"}) == OutputFormat("regex", "[a-z]+", "guided_regex")
    assert output({"guided_grammar": 'start: "a"'}) == OutputFormat("grammar", 'start: "a"', "guided_grammar")
    assert parse_body({"prompt": "x", "n": 3, "best_of": 3}, "completion", DEFAULTS).n == 3


def test_log_probabilities_that_are_not_finite_are_answered_as_the_floor():
    """JSON has no NaN nor infinity: such log-probabilities (after an extreme penalty) get a finite floor."""
    logprobs = [-0.5, float("nan"), float("-inf"), float("inf")]
    floor = responses.LOGPROB_FLOOR

    class Letters:  # token i reads as the i-th letter
        def decode(self, ids):
            return "".join(chr(ord("a") + i) for i in ids)

        def token_text(self, i):
            return self.decode([i])

    result = Result(0, "abcd", [0, 1, 2, 3], "length", None, 1, Timings(), logprobs)
    result.top_logprobs = [[(i, lp)] for i, lp in enumerate(logprobs)]
    options = output_options({"logprobs": True, "top_logprobs": 1}, "chat")
    chat = answer_logprobs("chat", Letters(), options, [0], result)
    assert [t["logprob"] for t in chat["content"]] == [-0.5, floor, floor, floor]
    assert [t["top_logprobs"][0]["logprob"] for t in chat["content"]] == [-0.5, floor, floor, floor]
    text = answer_logprobs("completion", Letters(), output_options({"logprobs": 1}, "completion"), [0], result)
    assert text["token_logprobs"] == [-0.5, floor, floor, floor]
    assert text["tokens"] == ["a", "b", "c", "d"] and text["text_offset"] == [0, 1, 2, 3]
    assert [t["a"] if i == 0 else next(iter(t.values())) for i, t in enumerate(text["top_logprobs"])] == [
        -0.5,
        floor,
        floor,
        floor,
    ]
    json.dumps([chat, text], allow_nan=False)
