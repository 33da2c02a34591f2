"""Run a job file: every line answered, in input order, each written and flushed as soon as it and all lines
before it are done; resumable (ids already in the output are skipped); bad lines become error records.

One line's way through: `read_line` (its id and shape) -> `JobLine.request` (its kind and body) ->
`RequestPipeline.prepare` (checked fields, prompt token ids) -> `Generation.submit` -> the engine's steps ->
`records.success` (or `records.failure` for whatever the line raised on the way) -> `OrderedWriter.put`.

Multi-host: every process reads the same job and runs the same engine loop; only process 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxllama.batch import records
from jaxllama.batch.jobs import JobLine, read_line
from jaxllama.batch.progress import Progress
from jaxllama.batch.writer import OrderedWriter
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.runtime import broadcast_from_main
from jaxllama.errors import DuplicateId
from jaxllama.protocol.pipeline import PreparedRequest, RequestPipeline


@dataclasses.dataclass
class JobStats:
    requests: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # already in the output (resume)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: list = dataclasses.field(default_factory=list)


def default_output(job: Path) -> Path:
    name = job.name[: -len(".jsonl")] if job.name.endswith(".jsonl") else job.name
    return job.with_name(f"{name}.out.jsonl")


def completed_ids(output: Path) -> set:
    """Ids answered in an existing output; a truncated last line (a killed run) is cut off the file."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(output, "r+b") as f:
            f.truncate(end)
    done = set()
    for raw in data[:end].splitlines():
        try:
            done.add(records.record_id(json.loads(raw)))
        except (ValueError, KeyError, TypeError):
            continue
    return done


def run_job(
    llm,
    job: Path,
    output: Path | None = None,
    *,
    defaults: SamplingParams,
    stop: list[str],
    system_prompt: str | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    write: bool = True,
) -> tuple[JobStats, dict]:
    """Run a job file with a loaded `LLM`. Returns (job statistics, summary dict)."""
    job = Path(job)
    output = Path(output) if output else default_output(job)
    lines = read_job(job)
    if overwrite and write and output.exists():
        output.unlink()
    done = completed_ids(output) if write else set()
    stats = JobStats()
    todo = _lines_to_run(lines, done, stats)

    start = time.perf_counter()
    engine_stats_before = dataclasses.replace(llm.engine.stats)
    pipeline = RequestPipeline(llm, defaults, tuple(stop), system_prompt, output_options=False)
    progress = Progress(total=len(todo), quiet=quiet, initial_skipped=stats.skipped)
    try:
        with OrderedWriter(output if write else None, [line.number for line, _ in todo]) as writer:
            batch = _Batch(llm, pipeline, writer, stats, progress)
            for line, duplicate in todo:
                if duplicate is None:
                    batch.submit(line)
                else:
                    batch.fail(line, duplicate)
            batch.generate()
    finally:
        progress.close()
    stats.wall_s = time.perf_counter() - start
    return stats, summary(stats, llm, engine_stats_before)


def read_job(job: Path) -> list[JobLine]:
    """The job's lines (blank ones left out, the others keeping their line numbers)."""
    try:
        text = job.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OSError(f"{job}: cannot read the job file ({e})") from None
    return [read_line(raw, number) for number, raw in enumerate(text.splitlines(), start=1) if raw.strip()]


def _lines_to_run(lines: list[JobLine], done: set, stats: JobStats) -> list[tuple[JobLine, DuplicateId | None]]:
    """The lines not answered yet, each with the DuplicateId it fails with if an earlier line has its id. Counts
    the job's requests and those skipped in `stats`."""
    todo, seen = [], set()
    for line, skip in zip(lines, _skipped_lines(lines, done), strict=True):
        stats.requests += 1
        if skip:
            stats.skipped += 1
            continue
        duplicate = DuplicateId(f"id {line.id!r} is used by an earlier line") if line.id in seen else None
        seen.add(line.id)
        todo.append((line, duplicate))
    return todo


def _skipped_lines(lines: list[JobLine], done: set) -> np.ndarray:
    """Per line: already answered (its id in `done`), as process 0 sees it, on every process."""
    skip = np.array([line.id in done for line in lines], dtype=np.uint8)
    return broadcast_from_main(skip).astype(bool)


class _Batch:
    """The job's requests on the engine: each line submitted or failed at once, then answered as the engine
    finishes it; every record goes to the writer, and is counted in the statistics and the progress."""

    def __init__(self, llm, pipeline: RequestPipeline, writer: OrderedWriter, stats: JobStats, progress: Progress):
        self.llm, self.pipeline, self.writer, self.stats, self.progress = llm, pipeline, writer, stats, progress
        self.running: dict[int, tuple[JobLine, PreparedRequest]] = {}  # by line number, the engine's request id

    def submit(self, line: JobLine) -> None:
        """Queue a line on the engine, or write its error record if it cannot run."""
        try:
            kind, body = line.request()
            request = self.pipeline.prepare(body, kind)
            # Longest first (by max_tokens): the job then ends with its short requests, rather than with a tail of
            # decode steps that run a few long ones in nearly empty batches. Output stays in file order.
            priority = request.params.max_tokens
            self.llm.generation.submit(line.number, request.prompt, request.params, request.stop, priority=priority)
        except ValueError as e:  # what the line, its encoding or the engine's checks found wrong with it
            self.fail(line, e)
            return
        self.running[line.number] = (line, request)

    def fail(self, line: JobLine, error: Exception) -> None:
        self.writer.put(line.number, records.failure(line, error))
        self.stats.failed += 1
        self.progress.update(ok=False, tokens=0)

    def generate(self) -> None:
        """Step the engine until every submitted line is answered."""
        model_name = self.llm.name
        while self.llm.generation.has_work():
            for event in self.llm.generation.step():
                if event.result is None:
                    continue
                line, request = self.running.pop(event.id)
                result = event.result
                self.writer.put(line.number, records.success(line, request, result, model_name))
                self.stats.ok += 1
                self.stats.prompt_tokens += result.prompt_tokens
                self.stats.completion_tokens += len(result.token_ids)
                self.stats.ttft_ms.append(result.timings.ttft_ms)
                self.progress.update(ok=True, tokens=len(result.token_ids))


def summary(stats: JobStats, llm, before) -> dict:
    e = llm.engine.stats
    prefill_s, decode_s = e.prefill_s - before.prefill_s, e.decode_s - before.decode_s
    prefill_tokens, generated = e.prefill_tokens - before.prefill_tokens, e.generated_tokens - before.generated_tokens
    steps = e.decode_steps - before.decode_steps
    slot_steps = e.slot_steps - before.slot_steps
    ttft = np.array(stats.ttft_ms) if stats.ttft_ms else np.zeros(1)
    wall = max(stats.wall_s, 1e-9)
    out = {
        "requests": stats.requests,
        "ok": stats.ok,
        "failed": stats.failed,
        "skipped": stats.skipped,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "wall_s": round(stats.wall_s, 3),
        "compile_s": round(e.compile_s - before.compile_s, 3),
        "programs": e.compiles - before.compiles,
        "requests_per_s": round((stats.ok + stats.failed) / wall, 3),
        "output_tokens_per_s": round(stats.completion_tokens / wall, 2),
        "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1) if prefill_s else 0.0,
        "decode_tokens_per_s": round(generated / decode_s, 1) if decode_s else 0.0,
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p95": round(float(np.percentile(ttft, 95)), 1),
        "slot_occupancy": round(slot_steps / max(1, steps * llm.engine.slots), 3),
        "decode_steps": steps,
        "slots": llm.engine.slots,
    }
    out["hosts"] = _per_host(stats.wall_s, prefill_s, decode_s, e.compile_s - before.compile_s)
    return out


def _per_host(wall_s, prefill_s, decode_s, compile_s) -> list[dict]:
    """Each host's own times (gathered across processes), so that a slow host shows."""
    import jax

    mine = np.array([wall_s, prefill_s, decode_s, compile_s], np.float64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    else:
        rows = mine[None]
    keys = ("wall_s", "prefill_s", "decode_s", "compile_s")
    return [
        {"process": i, **{k: round(float(v), 3) for k, v in zip(keys, row, strict=True)}} for i, row in enumerate(rows)
    ]


def print_summary(s: dict, file=sys.stderr) -> None:
    lines = [
        f"requests: {s['ok']} ok, {s['failed']} failed" + (f", {s['skipped']} already done" if s["skipped"] else ""),
        f"tokens: {s['prompt_tokens']} prompt, {s['completion_tokens']} completion",
        f"time: {s['wall_s']:.1f} s wall ({s['compile_s']:.1f} s compiling or loading {s['programs']} programs); "
        f"{s['requests_per_s']:.2f} requests/s",
        f"throughput: {s['output_tokens_per_s']:.1f} output tok/s; prefill {s['prefill_tokens_per_s']:.0f} tok/s, "
        f"decode {s['decode_tokens_per_s']:.1f} tok/s",
        f"latency: TTFT p50 {s['ttft_ms_p50']:.0f} ms, p95 {s['ttft_ms_p95']:.0f} ms; slot occupancy "
        f"{100 * s['slot_occupancy']:.0f}% of {s['slots']} slots",
    ]
    if len(s["hosts"]) > 1:
        lines += [
            f"host {h['process']}: wall {h['wall_s']:.1f} s, prefill {h['prefill_s']:.1f} s, "
            f"decode {h['decode_s']:.1f} s, compile {h['compile_s']:.1f} s"
            for h in s["hosts"]
        ]
    print("\n".join(lines), file=file, flush=True)
