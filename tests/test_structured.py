"""Structured output, n samples and logit_bias on SmolLM2, through `LLM` and the job runner: every constrained output
parses and matches its schema or regular expression (checked with `jsonschema` and `re`, not with the library that
constrained it), rows with different schemas share a batch, n samples are reproducible with a seed and the same
whatever shares the batch, and logit_bias moves the greedy choice as OpenAI defines it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxllama import LLM
from jaxllama.batch.runner import JobOptions, run_job
from jaxllama.errors import InvalidParameter
from jaxllama.text.structured import GrammarCompiler, OutputFormat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLORS = {
    "type": "object",
    "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["colors"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


@pytest.fixture(scope="module")
def llm(smollm2_checkpoint):
    return LLM.load(smollm2_checkpoint, mesh="data=1,model=1", max_slots=8, max_context=512, compilation_cache=False)


@pytest.fixture(scope="module")
def tiny(tiny_chat_checkpoint):
    """The tiny random model, in the shape the server tests load it (their compiled programs are reused)."""
    return LLM.load(tiny_chat_checkpoint, max_slots=8, max_context=64, compilation_cache=False)


def ask(content):
    return [{"role": "user", "content": content}]


@pytest.mark.slow
def test_rows_with_their_own_schemas_in_one_job_all_parse_and_validate(llm, tmp_path):
    """One job, one batch: two JSON schemas, any JSON object, a regular expression, n sampled answers to a schema,
    one cut by max_tokens and an unconstrained line; each constrained answer that ends with "stop" matches what its
    line asked for."""
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    lines = [
        {"id": "person", "messages": ask("Describe a person as JSON."), "response_format": person},
        {"id": "colors", "messages": ask("List two colors as JSON."), "guided_json": COLORS},
        {"id": "object", "messages": ask('Reply {"ok": true} as JSON.'), "response_format": {"type": "json_object"}},
        {"id": "date", "messages": ask("When did you last travel?"), "guided_regex": DATE},
        {"id": "sampled", "messages": ask("A person, as JSON."), "guided_json": PERSON, "n": 2, "temperature": 0.8},
        {"id": "cut", "messages": ask("A person, as JSON."), "guided_json": PERSON, "max_tokens": 3},
        {"id": "free", "messages": ask("Describe a person as JSON.")},
    ]
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"max_tokens": 32, "temperature": 0, "seed": 7, **x}) + "\n" for x in lines))
    stats, _ = run_job(llm, job, options=JobOptions(quiet=True))
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "job.out.jsonl").read_text().splitlines())}
    assert stats.ok == len(lines), records
    text = {key: r["message"]["content"] for key, r in records.items() if "message" in r}
    assert all(records[key]["finish_reason"] == "stop" for key in ("person", "colors", "object", "date")), records
    jsonschema.validate(json.loads(text["person"]), PERSON)
    jsonschema.validate(json.loads(text["colors"]), COLORS)
    assert isinstance(json.loads(text["object"]), dict)
    assert re.fullmatch(DATE, text["date"]), text["date"]
    sampled = records["sampled"]["choices"]
    assert [c["index"] for c in sampled] == [0, 1] and records["sampled"]["usage"]["completion_tokens"] > 0
    for choice in sampled:
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert records["cut"]["finish_reason"] == "length" and records["cut"]["usage"]["completion_tokens"] == 3
    assert text["free"] != text["person"]  # the constraint changed what the model would have said


def test_n_samples_are_reproducible_distinct_and_batch_invariant(tiny):
    prompt, sampling = "the cat sat on the mat", dict(max_tokens=6, temperature=1.0, seed=11)
    first = tiny.generate(prompt, n=4, **sampling)
    assert [r.text for r in first] == [r.text for r in tiny.generate(prompt, n=4, **sampling)]
    assert len({r.text for r in first}) > 1  # each sample draws from its own stream
    assert all(r.cached_tokens > 0 for r in first)  # the prompt's prefix is computed once for the n samples
    assert first[0].text == tiny.generate(prompt, **sampling).text  # sample 0 keeps the request's seed
    batched = tiny.generate([prompt, "hello there", prompt], n=4, **sampling)
    assert [r.text for r in batched[0]] == [r.text for r in first] == [r.text for r in batched[2]]


def test_logit_bias_forces_and_bans_tokens(tiny):
    prompt = "the cat sat on the mat"
    plain = tiny.generate(prompt, max_tokens=6, temperature=0)
    banned = plain.token_ids[0]
    without = tiny.generate(prompt, max_tokens=6, temperature=0, logit_bias={str(banned): -100})
    assert banned not in without.token_ids and without.token_ids != plain.token_ids
    (forced,) = tiny.tokenizer.encode("q")
    assert tiny.generate(prompt, max_tokens=4, temperature=0, logit_bias={forced: 100}).token_ids == [forced] * 4
    assert tiny.generate(prompt, max_tokens=6, temperature=0, logit_bias={forced: 0}).token_ids == plain.token_ids


def test_what_cannot_be_honoured_is_refused(tiny):
    with pytest.raises(InvalidParameter) as e:
        tiny.generate("x", guided_regex="(unclosed")
    assert e.value.param == "guided_regex"
    with pytest.raises(InvalidParameter) as e:
        tiny.generate("x", guided_grammar="start: undefined_rule")
    assert e.value.param == "guided_grammar"
    with pytest.raises(InvalidParameter) as e:
        tiny.generate("x", logit_bias={"10000000": 1})
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidParameter) as e:
        tiny.generate("x", max_tokens=4, min_tokens=2, guided_regex="[0-9]+")
    assert e.value.param == "min_tokens"
    with pytest.raises(ValueError):
        tiny.generate("x", n=2, stream=True)


def test_a_sentencepiece_tokenizer_is_refused_clearly():
    from jaxllama.text.sentencepiece_tokenizer import SentencePieceTokenizer

    compiler = GrammarCompiler(object.__new__(SentencePieceTokenizer), 32000, [2])
    with pytest.raises(InvalidParameter, match="tokenizer.json"):
        compiler.compile(OutputFormat("regex", "a+", "guided_regex"))


DEEP_LARK = "start: a30\n" + "".join(f"a{i + 1}: a{i} a{i}\n" for i in range(30)).replace("a0 a0", '"x" "x"')


@pytest.mark.slow
@pytest.mark.parametrize(
    "field, value",
    [("guided_regex", "a{1000000}"), ("guided_grammar", DEEP_LARK)],
    ids=["regex-too-many-states", "lark-2^30-x"],
)
def test_a_grammar_past_the_matchers_limits_is_an_error_never_stop(tiny, tmp_path, field, value):
    """llguidance accepts these grammars and fails after the first token: the answer is an error naming the field,
    from `LLM.generate` and as the line's error record in a job, whose other lines are answered."""
    with pytest.raises(InvalidParameter, match="cannot be followed after 1 token ") as e:
        tiny.generate("x", max_tokens=8, temperature=1.0, **{field: value})
    assert e.value.param == field
    assert tiny.generate("x", max_tokens=3, temperature=0).finish_reason == "length"  # the engine goes on
    job = tmp_path / "job.jsonl"
    lines = [{"id": "bad", "prompt": "x", "max_tokens": 8, field: value}, {"id": "ok", "prompt": "x", "max_tokens": 3}]
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stats, _ = run_job(tiny, job, options=JobOptions(quiet=True))
    bad, ok = (json.loads(line) for line in (tmp_path / "job.out.jsonl").read_text().splitlines())
    assert stats.failed == 1 and bad["error"]["code"] == "invalid_parameter" and field in bad["error"]["message"]
    assert ok["usage"]["completion_tokens"] == 3


def test_a_grammar_that_fails_at_once_is_refused_when_it_arrives(tiny):
    with pytest.raises(InvalidParameter, match="cannot be followed at the first token") as e:
        tiny.generate("x", guided_json={"$ref": "#"})
    assert e.value.param == "guided_json"


def test_an_open_stream_keeps_its_events_while_other_calls_run(tiny):
    """A stream not yet read to its end, then a whole `generate` and a `score`: each call gets its own events (the
    stream's text whole, no KeyError), as each would alone."""
    alone = tiny.generate("the cat", max_tokens=10, temperature=0).text
    other = tiny.generate("a dog", max_tokens=6, temperature=0).text
    stream = tiny.generate("the cat", max_tokens=10, temperature=0, stream=True)
    pieces = [next(stream)]
    assert tiny.generate("a dog", max_tokens=6, temperature=0).text == other
    assert len(tiny.score(["a dog ran"])[0].logprobs) >= 1
    pieces += list(stream)
    assert "".join(pieces) == alone
    dropped = tiny.generate("the cat", max_tokens=10, temperature=0, stream=True)
    next(dropped)
    dropped.close()  # its request is cancelled, and no other call waits for it
    assert tiny.generate("a dog", max_tokens=6, temperature=0).text == other
