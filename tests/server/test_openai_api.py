"""The official `openai` client against the live server: chat and completions, whole and streamed, stop strings,
usage, log-probabilities, and the errors it raises for bad requests. The oracle for the text is the Python API
(`reference`, computed with the same engine before the server started)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from jaxllama.engine.request import SamplingParams
from tests.helpers.server import CHAT, CONTEXT, MODEL_NAME, PROMPT, SLOTS


def test_chat_completion_matches_the_python_api(live, reference):
    ref = reference["chat"]
    r = live.client().chat.completions.create(model="anything", messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL_NAME
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_matches_the_python_api(live, reference):
    ref = reference["text"]
    r = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == 12
    one = live.client().completions.create(model=MODEL_NAME, prompt=[PROMPT], max_tokens=12, temperature=0)
    assert one.choices[0].text == ref.text  # a list of one prompt is that prompt


def test_chat_stream_with_usage(live, reference):
    ref = reference["chat"]
    chunks = list(
        live.client().chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in body)
    assert finish.choices[0].finish_reason == ref.finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == len(ref.token_ids)
    assert usage.usage.prompt_tokens == ref.prompt_tokens


def test_completion_stream_without_usage(live, reference):
    ref = reference["text"]
    chunks = list(
        live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_stream_ends_with_done(live):
    """The raw server-sent events: `data: {...}` lines, then `data: [DONE]`."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines[-2].startswith('data: {"id": "cmpl-')


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(live, reference, stream):
    ref = reference["chat"].text
    start = next(i for i in range(1, len(ref) - 1) if "\ufffd" not in ref[i : i + 2])
    stop = ref[start : start + 2]
    expected = ref[: ref.index(stop)]
    client = live.client()
    request = dict(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0, stop=[stop, "never seen"])
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0]
    else:
        finish = client.chat.completions.create(**request).choices[0]
        text = finish.message.content
    assert text == expected and finish.finish_reason == "stop"
    assert finish.model_extra["stop_reason"] == stop


def test_chat_logprobs(live, reference):
    ref = reference["chat"]
    r = live.client().chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=0
    )
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(c.logprob <= 0 and c.top_logprobs == [] for c in content)


def test_completion_logprobs_streamed(live, reference):
    ref = reference["text"]
    chunks = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, stream=True
    )
    logprobs = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_n_choices_whole_and_streamed(live):
    """n samples of one prompt: choices indexed 0..n-1, usage counting every sample, and the same texts streamed
    (their chunks told apart by `index`) as answered whole, for the same seed."""
    request = dict(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=3)
    whole = live.client().chat.completions.create(**request)
    assert [c.index for c in whole.choices] == [0, 1, 2] and len({c.message.content for c in whole.choices}) > 1
    assert whole.usage.completion_tokens == 18 or all(c.finish_reason for c in whole.choices)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    texts, finished = ["", "", ""], set()
    stream = live.client().chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert texts == [c.message.content for c in whole.choices] and finished == {0, 1, 2}


@pytest.mark.slow
def test_guided_regex_and_logit_bias(live):
    """A regular expression that the tiny model's answer must match, ended by the grammar; a token that logit_bias
    raises by 100 comes every time."""
    client = live.client()
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert re.fullmatch("[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    (forced,) = live.llm.tokenizer.encode("q")
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, logit_bias={str(forced): 100})
    assert r.choices[0].text == "qqqq"


def test_a_grammar_past_the_matchers_limits_is_an_error_whole_or_streamed(live):
    """A grammar llguidance fails on at the first token is refused (400); one it fails on later answers 400 whole,
    and ends a stream with an error event (the `openai` client raises it), never with finish_reason "stop"."""
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"guided_json": {"$ref": "#"}})
    assert e.value.body["param"] == "guided_json"
    limit = {"guided_regex": "a{1000000}"}
    with pytest.raises(openai.BadRequestError, match="cannot be followed") as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, extra_body=limit)
    assert e.value.body["param"] == "guided_regex"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=8, stream=True, extra_body=limit
    )
    with pytest.raises(openai.APIError, match="cannot be followed"):
        for chunk in stream:
            assert all(c.finish_reason is None for c in chunk.choices)


def test_max_tokens_default_and_max_completion_tokens(live):
    client = live.client()
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0)
    assert r.usage.completion_tokens == 16  # the server's --max-tokens (conftest)
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3


def test_huge_limits_mean_the_context_and_the_vocabulary(live):
    """Values past what the engine holds in int32 arrays are bounded before they reach it: the engine thread,
    shared by every request, must not fail."""
    r = live.client().chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=10**12, extra_body={"top_k": 10**12}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == CONTEXT
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, extra_body={"stop_token_ids": [10**12]})
    assert e.value.param == "stop_token_ids" and "outside the vocabulary" in e.value.message
    assert live.worker.alive


@pytest.mark.parametrize(
    "change, param, code",
    [
        ({"temperature": -1}, "temperature", "invalid_parameter"),
        ({"top_p": 1.5}, "top_p", "invalid_parameter"),
        ({"max_tokens": 0}, "max_tokens", "invalid_parameter"),
        ({"n": 0}, "n", "invalid_parameter"),
        ({"seed": -1}, "seed", "invalid_parameter"),
        ({"presence_penalty": 3}, "presence_penalty", "invalid_parameter"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "invalid_parameter"),
        ({"top_k": -1}, "top_k", "invalid_parameter"),  # the fields OpenAI lacks arrive too
        ({"min_p": 2}, "min_p", "invalid_parameter"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_parameter"),
        ({"max_completion_tokens": True}, "max_completion_tokens", "invalid_parameter"),
        ({"stop": [""]}, "stop", "invalid_parameter"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_parameter"),
        ({"messages": [{"role": "robot", "content": "beep"}]}, "messages", "invalid_messages"),
        ({"messages": []}, "messages", "invalid_messages"),
        ({"messages": [{"role": "user", "content": "the " * 300}]}, "messages", "context_length_exceeded"),
    ],
)
def test_invalid_chat_requests_are_400(live, change, param, code):
    request = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4}
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(**request, extra_body=change)
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    assert e.value.param == param and e.value.code == code and e.value.message


def test_invalid_completion_requests_are_400(live):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="the " * 300, max_tokens=4, stream=True)
    assert e.value.code == "context_length_exceeded" and "context limit" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=21)
    assert e.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=[])
    assert e.value.param == "prompt"


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""], ids=["invalid-json", "not-an-object", "empty"])
def test_bodies_fastapi_rejects_are_400_with_the_openai_error_object(live, content):
    r = httpx.post(
        f"{live.url}/v1/chat/completions", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"]


def test_unknown_path_is_404_with_the_openai_error_object(live):
    r = httpx.get(f"{live.url}/v1/embeddings", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


BAD_BODIES = [
    ("chat", {"messages": CHAT, "top_p": 1.5}),
    ("chat", {"messages": CHAT, "n": 0}),
    ("chat", {"messages": [{"role": "robot", "content": "beep"}]}),
    ("chat", {"messages": [{"role": "user", "content": "the " * 300}]}),
    ("chat", {"messages": CHAT, "stop_token_ids": [10**12]}),
    ("completion", {"prompt": "the " * 300}),
    ("completion", {"prompt": [[1, 2], []]}),
    ("completion", {"prompt": PROMPT, "max_tokens": 0}),
]


def test_a_job_line_and_a_request_with_the_same_bad_body_get_the_same_code(live, tiny_chat_checkpoint, tmp_path):
    """`jaxllama run` and `jaxllama serve` read bodies through one pipeline and answer failures through one table:
    the same bad body gets the same code from both, on a plain job line and on an OpenAI Batch line."""
    from jaxllama.batch.runner import JobOptions, run_job
    from jaxllama.llm import LLM

    served = []
    for kind, body in BAD_BODIES:
        url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        r = httpx.post(f"{live.url}{url}", json=body, timeout=30)
        assert r.status_code == 400
        served.append(r.json()["error"]["code"])
    assert len(set(served)) >= 3  # the bodies fail in different ways

    lines = []
    for i, (kind, body) in enumerate(BAD_BODIES):
        url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        lines += [{"id": f"p{i}", **body}, {"custom_id": f"o{i}", "method": "POST", "url": url, "body": body}]
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    llm = LLM.load(tiny_chat_checkpoint, max_slots=SLOTS, max_context=CONTEXT, compilation_cache=False)
    stats, _ = run_job(llm, job, options=JobOptions(SamplingParams(max_tokens=4), quiet=True))
    assert stats.failed == len(lines)
    records = [json.loads(line) for line in (tmp_path / "job.out.jsonl").read_text().splitlines()]
    codes = [r["response"]["body"]["error"]["code"] if "custom_id" in r else r["error"]["code"] for r in records]
    assert codes == [code for code in served for _ in range(2)]
