"""Job lines read one at a time (`jaxllama.batch.jobs`), their error records (`records.failure`) and the ordered
writer, without a model: a line's id and shape are known even when the line is bad."""

from __future__ import annotations

import json

import pytest

from jaxllama import errors as E
from jaxllama.batch import records
from jaxllama.batch.jobs import read_job, read_line
from jaxllama.batch.writer import OrderedWriter
from jaxllama.engine.request import SamplingParams
from jaxllama.protocol import errors
from jaxllama.protocol.pipeline import RequestPipeline
from tests.helpers.protocol import Characters

OPENAI = {"custom_id": "b1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}


@pytest.mark.parametrize(
    "raw, rid, openai",
    [
        ({"id": "a", "prompt": "x"}, "a", False),
        ({"id": 7, "prompt": "x"}, 7, False),
        ({"prompt": "x"}, 3, False),  # no id: the line number
        ({"id": True, "prompt": "x"}, 3, False),
        (OPENAI, "b1", True),
        ({**OPENAI, "id": "not this"}, "b1", True),  # an OpenAI line is answered under its custom_id
        ({"body": {"prompt": "x"}}, 3, True),  # an OpenAI line without a custom_id: an OpenAI error record
        ('{"custom_id": "b1", "body": {', 3, True),  # not JSON, but meant as an OpenAI line
        ("{not json", 3, False),
        ([1, 2], 3, False),
    ],
)
def test_a_line_has_one_id_and_shape(raw, rid, openai):
    line = read_line(raw if isinstance(raw, str) else json.dumps(raw), 3)
    assert (line.id, line.openai) == (rid, openai)


@pytest.mark.parametrize(
    "raw, error, code",
    [
        ("{not json", E.InvalidJSON, "invalid_json"),
        ("[1, 2]", E.InvalidRequest, "invalid_request"),
        ({"id": None, "prompt": "x"}, E.InvalidRequest, "invalid_request"),
        ({"id": "a", "text": "x"}, E.InvalidRequest, "invalid_request"),
        ({**OPENAI, "url": "/v1/embeddings"}, E.UnsupportedEndpoint, "invalid_url"),
        ({**OPENAI, "method": "GET"}, E.InvalidRequest, "invalid_request"),
        ({**OPENAI, "custom_id": ""}, E.InvalidRequest, "invalid_request"),
        ({**OPENAI, "body": "x"}, E.InvalidRequest, "invalid_request"),
    ],
)
def test_bad_lines_raise_their_error_class(raw, error, code):
    line = read_line(raw if isinstance(raw, str) else json.dumps(raw), 5)
    with pytest.raises(error) as e:
        line.request()
    record = records.failure(line, e.value)
    if line.openai:
        assert record["custom_id"] == line.id and record["response"]["status_code"] == 400
        assert record["response"]["body"]["error"] | {"message": None} == {
            "message": None,
            "type": "invalid_request_error",
            "param": None,
            "code": code,
            "line": 5,
        }
    else:
        assert record == {"id": line.id, "error": {"code": code, "message": e.value.message, "line": 5}}


def test_requests_of_good_lines():
    assert read_line(json.dumps(OPENAI), 1).request() == ("completion", {"prompt": "x"})
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert read_line(json.dumps(chat), 1).request() == ("chat", chat)


def test_error_records_take_the_code_of_the_class_whatever_the_message():
    line = read_line('{"id": "q", "prompt": "x"}', 4)
    for error, code in [
        (E.ContextLengthExceeded("this prompt is far too long"), "context_length_exceeded"),
        (E.DuplicateId("id 'q' is used by an earlier line"), "duplicate_id"),
        (E.InvalidParameter("stop_token_ids=[999]: outside the vocabulary", "stop_token_ids"), "invalid_parameter"),
        (ValueError("the context limit is 256"), "invalid_request"),
    ]:
        assert records.failure(line, error)["error"] == {"code": code, "message": str(error), "line": 4}


@pytest.mark.parametrize(
    "body, kind",
    [
        ({"prompt": "x", "top_p": 1.5}, "completion"),
        ({"prompt": "x", "n": 0}, "completion"),
        ({"prompt": ["a", 3]}, "completion"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "chat"),
        ({"messages": []}, "chat"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": True}, "chat"),
    ],
)
def test_a_job_line_gets_the_code_the_server_answers(body, kind):
    """The same body fails with the same class on a job line (its own line or an OpenAI line's body) as in the
    server's pipeline, and so gets the same code."""
    with pytest.raises(E.RequestError) as served:
        RequestPipeline(Characters(), SamplingParams()).prepare(body, kind)
    expected = errors.failure(served.value, kind).code
    url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    job = RequestPipeline(Characters(), SamplingParams(), output_options=False)
    for raw in [{"id": "a", **body}, {"custom_id": "a", "method": "POST", "url": url, "body": body}]:
        line = read_line(json.dumps(raw), 1)
        with pytest.raises(E.RequestError) as e:
            line_kind, line_body = line.request()
            job.prepare(line_body, line_kind)
        record = records.failure(line, e.value)
        code = record["response"]["body"]["error"]["code"] if line.openai else record["error"]["code"]
        assert code == expected


def test_the_writer_keeps_the_input_order(tmp_path):
    out = tmp_path / "out.jsonl"
    with OrderedWriter(out, [2, 5, 9]) as writer:
        writer.put(5, {"id": 5})
        assert out.read_text() == ""  # line 2 is not done
        writer.put(2, {"id": 2})
        assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [2, 5]  # flushed at once
        writer.put(9, {"id": "é"})
    assert out.read_text().splitlines()[-1] == '{"id": "é"}'
    with OrderedWriter(None, [1]) as nothing:  # a process that does not write
        nothing.put(1, {"id": 1})


def test_a_line_nested_past_the_recursion_limit_is_that_lines_error():
    line = read_line("[" * 100_000, 4)
    assert (line.id, line.openai) == (4, False)
    with pytest.raises(E.InvalidJSON, match="not valid JSON"):
        line.request()


@pytest.mark.parametrize(
    "raw, rid",
    [
        (r'{"id": "a", "prompt": "scraped \udc00 text"}', "a"),
        (r'{"id": "a", "messages": [{"role": "user", "content": "\ud800"}]}', "a"),
        (r'{"id": "bad\udc00id", "prompt": "x"}', "bad\udc00id"),
        (r'{"custom_id": "b", "url": "/v1/completions", "body": {"model": "m\udc00", "prompt": "x"}}', "b"),
    ],
)
def test_a_lone_surrogate_escape_fails_its_line_and_its_record_is_written(raw, rid, tmp_path):
    line = read_line(raw, 2)
    assert line.id == rid
    with pytest.raises(E.InvalidRequest, match="lone surrogate") as e:
        line.request()
    assert records.failure(line, e.value)  # the line's record, written below
    out = tmp_path / "out.jsonl"
    with OrderedWriter(out, [2]) as writer:
        writer.put(2, records.failure(line, E.InvalidJSON("x")))
    (record,) = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert records.record_id(record) == rid  # escaped in the file, the same id read back
    assert read_line(r'{"id": "pair", "prompt": "\ud83d\ude00"}', 1).request()[1]["prompt"] == "\U0001f600"


def test_job_lines_end_at_newline_only_and_bad_bytes_cost_their_line(tmp_path):
    job = tmp_path / "job.jsonl"
    lines = [
        '{"id": "sep", "prompt": "a\u2028b\u2029c\u0085d"}',  # legal inside JSON strings
        '{"id": "cr",\r "prompt": "x"}',  # a bare CR is JSON whitespace
        '{"id": "crlf", "prompt": "y"}\r',  # Windows line ends
    ]
    data = "\ufeff" + "\n".join(lines) + "\n\n"  # a byte order mark, a blank line
    job.write_bytes(data.encode() + b'{"id": "latin", "prompt": "caf\xe9"}\n{"id": "after", "prompt": "z"}')
    read = read_job(job)
    assert [(line.number, line.id) for line in read] == [(1, "sep"), (2, "cr"), (3, "crlf"), (5, 5), (6, "after")]
    assert read[0].request()[1]["prompt"] == "a\u2028b\u2029c\u0085d"
    with pytest.raises(E.InvalidJSON, match="not valid UTF-8"):
        read[3].request()
    assert all(line.request() for line in read[:3] + read[4:])


class Engineless:
    """Stands in for `LLM.loop`: refuses a prompt with a fault that no check expects."""

    name = "none"

    def __init__(self):
        self.loop = self
        self.submitted = []

    def submit(self, request, on_event, id=None):
        if request.prompt == Characters().encode("boom"):
            raise RuntimeError("a fault of jaxllama's")
        self.submitted.append(id)
        return id


def test_an_unexpected_failure_is_that_lines_internal_error(tmp_path):
    from jaxllama.batch.progress import Progress
    from jaxllama.batch.runner import JobOnEngine, JobStats, Tally

    out, llm, stats = tmp_path / "out.jsonl", Engineless(), JobStats()
    pipeline = RequestPipeline(Characters(), SamplingParams(), output_options=False)
    with OrderedWriter(out, [1, 2]) as writer:
        batch = JobOnEngine(llm, pipeline, Tally(writer, stats, Progress(2, quiet=True)).add)
        batch.submit(read_line('{"id": "a", "prompt": "boom"}', 1))
        batch.submit(read_line('{"id": "b", "prompt": "fine"}', 2))
    assert llm.submitted == [2] and stats.failed == 1
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    message = 'internal error: RuntimeError("a fault of jaxllama\'s")'
    assert record["error"] == {"code": "internal_error", "message": message, "line": 1}
