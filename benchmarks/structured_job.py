"""A data-generation job under JSON schemas against the same job unconstrained: what structured output costs.

    python -m benchmarks.structured_job [--lines 200] [--max-tokens 128] [--max-batch 64] [--model CKPT]
                                        [--out DIR]

Writes DIR/structured.jsonl (LINES chat lines cycling through 10 JSON schemas, each given as OpenAI's
`response_format` json_schema, sampled at temperature 0.7 with a seed per line) and runs it with one loaded model
(`jaxllama.batch.runner.run_job`, as `jaxllama run` does); checks that every answer parses and validates against its
schema (`jsonschema`); then writes and runs DIR/free.jsonl, the same lines without `response_format`, each with
`max_tokens` set to the tokens its structured answer took and `ignore_eos`, so that both jobs generate the same
number of tokens per line and differ only in the constraint. Prints one JSON summary: each job's output tokens/s
over its wall time less its compile time, their ratio, and the count of answers that validate (those cut by
max_tokens end with "length" and are counted apart).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import fire
import jsonschema

from jaxllama import LLM
from jaxllama.batch.runner import JobOptions, run_job


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required or list(properties),
        "additionalProperties": False,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 40}
SCHEMAS = {
    "a person": _object({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": NAME}),
    "a book": _object(
        {
            "title": NAME,
            "author": NAME,
            "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
            "pages": {"type": "integer"},
        }
    ),
    "a product review": _object(
        {"product": NAME, "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": NAME}
    ),
    "a weather report": _object(
        {
            "city": NAME,
            "temperature_c": {"type": "number"},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "wind"]},
        }
    ),
    "a recipe": _object({"dish": NAME, "ingredients": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 5}}),
    "a movie": _object(
        {
            "title": NAME,
            "genre": {"enum": ["drama", "comedy", "action", "horror", "documentary"]},
            "year": {"type": "integer"},
        }
    ),
    "a company": _object({"name": NAME, "employees": {"type": "integer", "minimum": 1}, "public": {"type": "boolean"}}),
    "an animal": _object({"species": NAME, "legs": {"type": "integer", "minimum": 0, "maximum": 8}, "diet": NAME}),
    "a city": _object({"name": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0}}),
    "a to-do item": _object(
        {"task": NAME, "priority": {"enum": ["low", "medium", "high"]}, "done": {"type": "boolean"}}
    ),
}


def structured_job(path: Path, lines: int, max_tokens: int) -> None:
    kinds = list(SCHEMAS)
    with path.open("w") as f:
        for i in range(lines):
            kind = kinds[i % len(kinds)]
            schema = {"type": "json_schema", "json_schema": {"name": f"s{i % len(kinds)}", "schema": SCHEMAS[kind]}}
            line = {
                "id": f"{i}",
                "messages": [{"role": "user", "content": f"Invent {kind} (example {i}) and describe it as JSON."}],
                "max_tokens": max_tokens,
                "temperature": 0.7,
                "seed": i,
                "response_format": schema,
            }
            f.write(json.dumps(line) + "\n")


def free_job(path: Path, structured: Path, answers: Path) -> None:
    """The structured job's lines without response_format, each generating as many tokens as its answer took."""
    tokens = {r["id"]: r["usage"]["completion_tokens"] for r in map(json.loads, answers.read_text().splitlines())}
    with path.open("w") as f:
        for line in map(json.loads, structured.read_text().splitlines()):
            del line["response_format"]
            f.write(json.dumps({**line, "max_tokens": max(1, tokens[line["id"]]), "ignore_eos": True}) + "\n")


def check(output: Path) -> dict:
    """How many structured answers parse and validate, and how many were cut by max_tokens."""
    kinds = list(SCHEMAS)
    counts = {"valid": 0, "invalid": 0, "cut": 0, "errors": 0}
    for record in map(json.loads, output.read_text().splitlines()):
        if "error" in record:
            counts["errors"] += 1
            continue
        if record["finish_reason"] == "length":
            counts["cut"] += 1
            continue
        try:
            jsonschema.validate(
                json.loads(record["message"]["content"]), SCHEMAS[kinds[int(record["id"]) % len(kinds)]]
            )
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError):
            counts["invalid"] += 1
    return counts


def main(
    lines: int = 200, max_tokens: int = 128, max_batch: int = 64, model: str | None = None, out: str | None = None
):
    folder = Path(out or tempfile.mkdtemp(prefix="structured-job-"))
    folder.mkdir(parents=True, exist_ok=True)
    structured, free = folder / "structured.jsonl", folder / "free.jsonl"
    structured_job(structured, lines, max_tokens)
    start = time.perf_counter()
    llm = LLM.load(model, max_slots=max_batch)
    load_s = time.perf_counter() - start
    summary = {"lines": lines, "max_tokens": max_tokens, "max_batch": max_batch, "load_s": round(load_s, 1)}
    for name, job in (("structured", structured), ("free", free)):
        if name == "free":
            free_job(free, structured, folder / "structured.out.jsonl")
        _, s = run_job(llm, job, options=JobOptions(overwrite=True, quiet=True))
        run_s = s["wall_s"] - s["compile_s"]
        summary[name] = {
            "completion_tokens": s["completion_tokens"],
            "wall_s": s["wall_s"],
            "compile_s": s["compile_s"],
            "output_tokens_per_s": round(s["completion_tokens"] / run_s, 1),
            "decode_tokens_per_s": s["decode_tokens_per_s"],
        }
        if name == "structured":
            summary[name] |= check(folder / "structured.out.jsonl")
    ratio = summary["structured"]["output_tokens_per_s"] / summary["free"]["output_tokens_per_s"]
    summary["structured_over_free"] = round(ratio, 3)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    fire.Fire(main)
