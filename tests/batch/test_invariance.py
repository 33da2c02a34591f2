"""Batch invariance, where a user meets it: every line of a generated job gets the record it gets run alone.

A seeded generator writes mixed jobs (`mixed_job`): prompts of lengths around the cache's buckets, shared prefixes,
greedy and seeded lines, n > 1, stop strings, log-probabilities, structured lines, vLLM's `ignore_eos` and
`min_tokens`. The job runs on one engine of a few slots that admits prompts in chunks, so that its cache grows,
shrinks and grows again, slots are reused and prefixes are read from other requests'; each line is then run alone,
as a one-line job on a freshly loaded model, and the two records must be the same (but for timings and the cached
tokens). On the CPU kernels a record is the same to the bit; on XLA's path (a CPU mesh, a paged cache) tokens and
text are the same and log-probabilities agree to XLA's rounding, which differs with a product's row count.

    JAXLLAMA_INVARIANCE_LINES=1000 JAXLLAMA_INVARIANCE_SEED=1 pytest tests/batch/test_invariance.py -k cpu

runs 1,000 generated lines on the CPU kernels (benchmarks/README.md records such runs).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from jaxllama import LLM
from jaxllama.batch.runner import JobOptions, run_job

LINES = int(os.environ.get("JAXLLAMA_INVARIANCE_LINES", "8"))
SEED = int(os.environ.get("JAXLLAMA_INVARIANCE_SEED", "0"))
CONTEXT = 2048
WORDS = "the cat sat on a mat in hat then ran to sea and ate the red apple while it rained".split()
# Prompt lengths (characters: about as many tokens in the tiny model's byte-level vocabulary) at and around the
# cache's buckets (128, 192, 256, 384, 512, 768, 1024, 1536 positions) and the prompt buckets of a row prefill: the
# cache shrinks when what it holds falls to a quarter of its length, and grows again for a longer one.
LENGTHS = (5, 20, 60, 120, 126, 130, 180, 190, 200, 250, 260, 370, 390, 500, 520, 700, 900, 1100, 1450)
# How far a log-probability may move with what shares its steps: not at all on the CPU kernels; on XLA's path by its
# rounding, which differs with a product's row count and grows through the layers of a model whose logits are tens
# apart (seen: 1.6e-5 of a log-probability of -1.57).
TOLERANCE = {"cpu-kernels": 0.0, "xla-mesh": 1e-4, "xla-paged": 1e-4}
BACKENDS = {
    # one device: the CPU kernels (the tests' 8 virtual devices would make a default mesh of data=8, XLA's path);
    # prompts past 96 tokens a step computed in chunks
    "cpu-kernels": dict(mesh="data=1,model=1", max_slots=4, step_tokens=96),
    "xla-mesh": dict(mesh="data=2,model=2", cpu_kernels=False, max_slots=4),
    # prompts and decode rows in mixed steps (`model.Mixed`), prompts past 96 tokens a step in chunks of whole pages
    "xla-paged": dict(mesh="data=1,model=2", cpu_kernels=False, page_size=16, max_slots=4, step_tokens=96),
}


def text(rng: random.Random, length: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < length:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:length]


def mixed_job(n: int, seed: int) -> list[dict]:
    """n job lines drawn from `seed`: chat and completion lines, a third of them starting with one of a few shared
    prefixes; each line's sampling is greedy or seeded, so that its answer alone is fixed."""
    rng = random.Random(seed)
    prefixes = [text(rng, rng.choice((130, 260, 400))) for _ in range(3)]
    lines = []
    for i in range(n):
        body = text(rng, rng.choice(LENGTHS))
        if rng.random() < 0.35:
            body = rng.choice(prefixes) + " " + body[: rng.choice((5, 30, 90))]
        line = {"id": f"l{i}", "max_tokens": rng.choice((1, 4, 16, 40, 90))}
        chat = rng.random() < 0.5
        if chat:
            line["messages"] = [{"role": "user", "content": body}]
        else:
            line["prompt"] = body
        if rng.random() < 0.5:
            line["temperature"] = 0
        else:
            line.update(temperature=rng.choice((0.7, 1.0)), seed=rng.randrange(1 << 30), top_p=rng.choice((1, 0.9)))
        extra = rng.random()
        if extra < 0.15:
            line["n"], line["seed"] = rng.choice((2, 3)), rng.randrange(1 << 30)
        elif extra < 0.3:
            line["stop"] = [rng.choice(("e", "at", " the", "\n"))]
        elif extra < 0.55:
            line["guided_regex"] = "[a-z]{1,6}( [a-z]{1,6}){0,4}"
        elif extra < 0.65:
            line.update(ignore_eos=True, min_tokens=min(3, line["max_tokens"]))
        elif extra < 0.7:
            line["repetition_penalty"] = 1.3
        if rng.random() < 0.6:  # a random model's text soon repeats itself: its log-probabilities tell more
            line.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
        lines.append(line)
    return lines


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def comparable(record: dict) -> dict:
    """A record without what depends on what else ran: its timings and the prompt tokens it found cached."""
    record = {k: v for k, v in record.items() if k != "timings"}
    usage = record.get("usage")
    if usage is not None:
        record["usage"] = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    return record


def job_and_alone(model: Path, options: dict, lines: list[dict], folder: Path) -> list[tuple[dict, dict, dict]]:
    """(line, its record in the job, its record run alone) for each line: the job on one freshly loaded model, each
    line alone as a one-line job on another."""
    job = write(folder / "job.jsonl", lines)
    run_job(LLM.load(model, **options), job, folder / "job.out.jsonl", JobOptions(quiet=True))
    together = [json.loads(r) for r in (folder / "job.out.jsonl").read_text().splitlines()]
    assert [r.get("id") for r in together] == [line["id"] for line in lines]
    assert not any("error" in r for r in together), [r for r in together if "error" in r][:3]
    out = []
    for line, record in zip(lines, together, strict=True):
        one = write(folder / "alone.jsonl", [line])
        run_job(LLM.load(model, **options), one, folder / "alone.out.jsonl", JobOptions(quiet=True, overwrite=True))
        (alone,) = (json.loads(r) for r in (folder / "alone.out.jsonl").read_text().splitlines())
        out.append((line, record, alone))
    return out


def differences(a, b, rel: float, where: str = "") -> list[str]:
    """Where two records differ: their structure and every string exactly, numbers to the relative `rel`."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], rel, f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, rel, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
        return [] if abs(a - b) <= rel * max(abs(a), abs(b), 1.0) else [f"{where}: {a} != {b}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def invariance_model(tmp_path_factory) -> Path:
    """A tiny random ChatML model with a context of 2,048 positions: room for the cache to grow past its buckets."""
    from converters.llama import convert
    from tests.factories import write_chat_gguf

    tmp = tmp_path_factory.mktemp("invariance")
    return convert(write_chat_gguf(tmp / "m.gguf", seed=3, context=CONTEXT), tmp / "ckpt", progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu-kernels", "xla-mesh"])
def test_a_cache_grown_shrunk_and_grown_again_answers_as_alone(invariance_model, tmp_path, backend):
    """Two slots: a long prompt grows the cache to 2,048 positions, short lines shrink it to 128, a medium one grows
    it to 384. A resize program compiled for one length once ran for every other from the same length: the medium
    line's cache got 2,048 positions, then shrank to 128 under it, and it answered otherwise."""
    story = text(random.Random(5), 1800)
    greedy = {"temperature": 0, "logprobs": 2}  # a random model's greedy text soon repeats itself: its numbers tell
    lines = [{"id": "long", "prompt": story, "max_tokens": 16, **greedy}]
    lines += [{"id": f"short{i}", "prompt": w, "max_tokens": 15, **greedy} for i, w in enumerate(WORDS[:3])]
    lines += [{"id": "medium", "prompt": story[:300], "max_tokens": 40, "ignore_eos": True, **greedy}]
    options = {**BACKENDS[backend], "max_slots": 2}
    rel = TOLERANCE[backend]
    for line, record, alone in job_and_alone(invariance_model, options, lines, tmp_path):
        assert not differences(comparable(record), comparable(alone), rel), line["id"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_line_of_a_mixed_job_is_answered_as_it_is_alone(invariance_model, tmp_path, backend):
    options = BACKENDS[backend]
    lines = mixed_job(LINES, SEED + sorted(BACKENDS).index(backend))
    assert (type(LLM.load(invariance_model, **options).engine.ops).__name__ == "CpuOps") == (backend == "cpu-kernels")
    rel = TOLERANCE[backend]
    found = []
    for line, record, alone in job_and_alone(invariance_model, options, lines, tmp_path):
        if diff := differences(comparable(record), comparable(alone), rel):
            found.append(f"{json.dumps(line)[:200]}: {diff[:3]}")
    assert not found, f"{len(found)} of {len(lines)} lines answered otherwise in the job (seed {SEED}):\n" + "\n".join(
        found[:10]
    )
