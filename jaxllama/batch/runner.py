"""Run a job file: every line answered, in input order; each finished line kept at once (the journal beside the
output, `writer.py`), so that a killed or interrupted job resumes where it stopped; bad lines become error records,
which a resumed run retries.

One line's way through: `read_line` (its id and shape) -> `JobLine.request` (its kind and body) ->
`RequestPipeline.prepare` (checked fields, prompt token ids) -> `PreparedRequest.text_requests` (a `TextRequest`) ->
`TextEngine.submit` -> the engine's steps ->
`records.success` (or `records.failure` for whatever the line raised on the way) -> `OrderedWriter.put`.

Multi-host: every process reads the same job and runs the same engine loop; only process 0 writes.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxllama.batch import records
from jaxllama.batch.jobs import JobLine, read_job, stream_job
from jaxllama.batch.progress import Progress
from jaxllama.batch.resume import Planner, load_records
from jaxllama.batch.settings import check_settings, record_settings, settings_path
from jaxllama.batch.writer import OrderedWriter, journal_path
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.runtime import broadcast_from_main
from jaxllama.engine.stats import EngineStats
from jaxllama.protocol.pipeline import PreparedRequest, RequestPipeline

__all__ = [
    "Answered",
    "JobInterrupted",
    "JobOnEngine",
    "JobOptions",
    "JobStats",
    "Tally",
    "answer_job",
    "default_output",
    "job_pipeline",
    "print_summary",
    "read_job",
    "run_job",
]


@dataclasses.dataclass
class JobStats:
    requests: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # already in the output (resume)
    kept_errors: int = 0  # of the skipped, error records kept as they are (retries off)
    retried: int = 0  # lines whose error record from an earlier run is replaced
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: array.array = dataclasses.field(default_factory=lambda: array.array("d"))  # 8 bytes a line

    @property
    def has_errors(self) -> bool:
        """Whether a line of the job has an error record, from this run or kept from an earlier one."""
        return bool(self.failed or self.kept_errors)


class JobInterrupted(Exception):
    """The job was interrupted (Ctrl-C); what finished is kept, and the same command resumes it."""

    def __init__(self, done: int, total: int, output: Path):
        super().__init__(
            f"{done} of {total} lines done, kept in {output} (and {journal_path(output).name}); "
            "run the same command again to resume"
        )
        self.done, self.total = done, total


def default_output(job: Path) -> Path:
    name = job.name[: -len(".jsonl")] if job.name.endswith(".jsonl") else job.name
    return job.with_name(f"{name}.out.jsonl")


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """How `run_job` runs a job, besides the model. What a line leaves unsaid (as `RequestPipeline`'s): `defaults`
    (its sampling parameters), `stop` strings, a `system_prompt` for conversations without one. What becomes of the
    output: `overwrite` (start over), `write` (false: the records are not written here, another process writes
    them), `retry_errors` (run again the lines whose record is an error), `settings` (`settings.job_settings`:
    checked against, and recorded beside, the output). `quiet`: no progress bar."""

    defaults: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    system_prompt: str | None = None
    overwrite: bool = False
    write: bool = True
    retry_errors: bool = True
    settings: dict | None = None
    quiet: bool = False


class Answered(NamedTuple):
    """A line's record, and what it counts for in the job's statistics (`ok`: an answer, not an error record)."""

    number: int
    record: dict
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0


class Tally:
    """Where a job's answered lines go: the ordered writer, the statistics and the progress."""

    def __init__(self, writer: OrderedWriter, stats: JobStats, progress: Progress):
        self.writer, self.stats, self.progress = writer, stats, progress

    def add(self, a: Answered) -> None:
        self.writer.put(a.number, a.record)
        if a.ok:
            self.stats.ok += 1
            self.stats.prompt_tokens += a.prompt_tokens
            self.stats.completion_tokens += a.completion_tokens
            self.stats.ttft_ms.append(a.ttft_ms)
        else:
            self.stats.failed += 1
        self.progress.update(ok=a.ok, tokens=a.completion_tokens)


def run_job(llm, job: Path, output: Path | None = None, options: JobOptions = JobOptions()) -> tuple[JobStats, dict]:
    """Run a job file with a loaded `LLM`. Returns (job statistics, summary dict). Raises SettingsChanged where
    the output was written with other settings, JobInterrupted on Ctrl-C after keeping what finished."""
    before = dataclasses.replace(llm.stats)

    def answer(lines: Iterator[JobLine], tally: Tally) -> None:
        batch = JobOnEngine(llm, job_pipeline(llm, options), tally.add)
        ended = False
        while True:
            if not ended:  # the engine's queue topped up: what it chooses among (longest first) is this many lines
                room = QUEUED_LINES - batch.running
                taken = 0
                for line in itertools.islice(lines, max(0, room)):
                    batch.submit(line)
                    taken += 1
                ended = taken < room
            if not batch.has_work():
                if ended:
                    return
                continue
            batch.step()

    stats = answer_job(job, output, options, answer)
    return stats, summary(stats, llm, before)


def job_pipeline(llm, options: JobOptions) -> RequestPipeline:
    """How a job's lines become the engine's requests: the model's prompts, and what the options say for what a
    line leaves unsaid."""
    return RequestPipeline(
        llm.prompts, options.defaults, tuple(options.stop), options.system_prompt, output_options=False
    )


def answer_job(
    job: Path,
    output: Path | None,
    options: JobOptions,
    answer: Callable[[Iterator[JobLine], Tally], None],
    agree: bool = True,
) -> JobStats:
    """Read the job, keep what an earlier run finished, and have `answer(lines, tally)` answer each line still to
    run, every record going through the ordered writer and its journal. `lines` is read from the job as `answer`
    asks for more (a job of any length in bounded memory); a line done already is written, and one whose id an
    earlier line has failed, as the reading passes it. `agree`: every process of a multi-host run takes process 0's
    decisions (false where only one process reads the job: a driver of replicas, which leaves the devices to
    them)."""
    o = options
    job = Path(job)
    output = Path(output) if output else default_output(job)
    stats, progress = JobStats(), None
    start = time.perf_counter()
    try:
        if o.write:
            _prepare_output(output, o.settings, o.overwrite)
        planner = Planner(load_records(output) if o.write else {}, o.retry_errors)
        planner.scan(stream_job(job))
        _count(planner, stats, agree)
        todo = stats.requests - stats.skipped
        progress = Progress(todo, quiet=o.quiet, initial_skipped=stats.skipped, retried=stats.retried)
        with OrderedWriter(output if o.write else None, kept=planner.done.values()) as writer:
            tally = Tally(writer, stats, progress)
            answer(_to_run(job, planner, writer, tally, agree), tally)
    except KeyboardInterrupt:
        raise JobInterrupted(stats.skipped + stats.ok + stats.failed, stats.requests, output) from None
    finally:
        if progress is not None:
            progress.close()
    stats.wall_s = time.perf_counter() - start
    return stats


# Lines read and decided at a time (a multi-host run agrees on each window's at once), and the most a one-process
# job's engine queues: what longest-first scheduling chooses among.
WINDOW_LINES = 4096
QUEUED_LINES = 16384


def _count(planner: Planner, stats: JobStats, agree: bool) -> None:
    """The job's counts from the scan, as process 0 (the one that reads the output) found them, on every process."""
    found = np.array([planner.lines, planner.kept, planner.kept_errors, planner.retried], np.int64)
    found = broadcast_from_main(found) if agree else found
    stats.requests, stats.skipped, stats.kept_errors, stats.retried = (int(x) for x in found)


def _to_run(job: Path, planner: Planner, writer: OrderedWriter, tally: Tally, agree: bool) -> Iterator[JobLine]:
    """The job's lines that run, read a window at a time; each line's place told to the writer as it is read, with
    its record where an earlier run answered it, or its error where its id is an earlier line's. The records of
    earlier runs whose ids no line has follow the job's lines."""
    last = 0
    for window in _windows(stream_job(job), WINDOW_LINES):
        decided = [(line, *planner.decide(line)) for line in window]
        if agree:  # process 0's records decide what is done, on every process
            done = np.array([record is not None for _, record, _ in decided], np.uint8)
            done = broadcast_from_main(done).astype(bool)
            decided = [
                (line, (record or {}) if d else None, dup)  # {}: a process that writes nothing holds nothing
                for (line, record, dup), d in zip(decided, done, strict=True)
            ]
        for line, record, duplicate in decided:
            writer.expect(line.number, record)
            if duplicate is not None:
                tally.add(Answered(line.number, records.failure(line, duplicate), ok=False))
            elif record is None:
                yield line
        last = window[-1].number
    for i, record in enumerate(planner.others()):
        writer.expect(last + 1 + i, record)
    writer.end()


def _prepare_output(output: Path, settings: dict | None, overwrite: bool) -> None:
    """Start over (`overwrite`), or check that the output was written with these settings; record them."""
    if overwrite:
        for path in (output, journal_path(output), settings_path(output)):
            path.unlink(missing_ok=True)
    elif settings is not None:
        check_settings(output, settings)
    if settings is not None:
        record_settings(output, settings)


def _windows(lines: Iterator[JobLine], size: int) -> Iterator[list[JobLine]]:
    lines = iter(lines)
    while window := list(itertools.islice(lines, size)):
        yield window


class JobOnEngine:
    """Job lines on an engine: each line submitted or failed at once, then answered as the engine finishes it; every
    line's `Answered` goes to `deliver`."""

    def __init__(self, llm, pipeline: RequestPipeline, deliver: Callable[[Answered], None]):
        self.llm, self.pipeline, self.deliver = llm, pipeline, deliver
        self.running = 0  # lines submitted and not answered

    def submit(self, line: JobLine) -> None:
        """Queue a line on the engine, or deliver its error record if it cannot run."""
        try:
            kind, body = line.request()
            request = self.pipeline.prepare(body, kind)
            # Longest first (by max_tokens): the job then ends with its short requests, rather than with a tail of
            # decode steps that run a few long ones in nearly empty batches. Output stays in file order.
            (one,) = request.text_requests(priority=request.params.max_tokens)
            on_event = functools.partial(self._answered, line, request, [None] * request.n)
            self.llm.loop.submit(one, on_event, id=line.number)
        except Exception as e:  # a line's failure, expected (a RequestError) or not, is its record
            self.fail(line, e)
            return
        self.running += 1

    def fail(self, line: JobLine, error: Exception) -> None:
        self.deliver(Answered(line.number, records.failure(line, error), ok=False))

    def generate(self) -> None:
        """Step the engine until every submitted line is answered."""
        while self.has_work():
            self.step()

    def has_work(self) -> bool:
        return self.llm.loop.has_work()

    def step(self) -> None:
        """One step of the engine; the lines it finishes are delivered (`_answered`)."""
        self.llm.loop.step()

    def _answered(self, line: JobLine, request: PreparedRequest, results: list, event) -> None:
        """A line's event: its choices' results gathered, the line answered at its last."""
        if event.result is not None:
            results[event.index] = event.result
        if event.last:
            self.running -= 1
            self._finish(line, request, results)

    def _finish(self, line: JobLine, request: PreparedRequest, results: list) -> None:
        error = next((r.error for r in results if r.error is not None), None)
        if error is not None:  # its grammar could not be followed to the end: no answer
            self.fail(line, error)
            return
        try:
            answer = results if request.n > 1 else results[0]
            record = records.success(line, request, answer, self.llm.name, self.llm.tokenizer)
        except Exception as e:  # one line's fault costs that line only
            self.fail(line, e)
            return
        tokens = sum(len(r.token_ids) for r in results)
        self.deliver(Answered(line.number, record, True, results[0].prompt_tokens, tokens, results[0].timings.ttft_ms))


def summary(stats: JobStats, llm, before: EngineStats) -> dict:
    """The job's summary: its lines' figures and what the engine did since `before` (its statistics then)."""
    e = EngineStats(
        **{f.name: getattr(llm.stats, f.name) - getattr(before, f.name) for f in dataclasses.fields(before)}
    )
    out = job_summary(stats, e, llm.slots)
    out["hosts"] = _per_host(stats.wall_s, e.prefill_s, e.decode_s, e.compile_s)
    return out


def job_summary(stats: JobStats, e: EngineStats, slots: int) -> dict:
    """The summary of a job whose lines `stats` counts, run by engines that did `e` with `slots` slots in all."""
    ttft = np.frombuffer(stats.ttft_ms, np.float64) if stats.ttft_ms else np.zeros(1)
    wall = max(stats.wall_s, 1e-9)
    out = {
        "requests": stats.requests,
        "ok": stats.ok,
        "failed": stats.failed,
        "skipped": stats.skipped,
        "kept_errors": stats.kept_errors,
        "retried": stats.retried,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "wall_s": round(stats.wall_s, 3),
        "compile_s": round(e.compile_s, 3),
        "programs": e.compiles,
        "requests_per_s": round((stats.ok + stats.failed) / wall, 3),
        "output_tokens_per_s": round(stats.completion_tokens / wall, 2),
        "prefill_tokens_per_s": round(e.prefill_tokens / e.prefill_s, 1) if e.prefill_s else 0.0,
        "decode_tokens_per_s": round(e.generated_tokens / e.decode_s, 1) if e.decode_s else 0.0,
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p95": round(float(np.percentile(ttft, 95)), 1),
        "slot_occupancy": round(e.occupancy(slots), 3),
        "decode_steps": e.decode_steps,
        "slots": slots,
    }
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


def _resumed(s: dict) -> str:
    said = f", {s['skipped']} already done" if s["skipped"] else ""
    said += f" ({s['kept_errors']} of them failed)" if s["kept_errors"] else ""
    return said + (f", {s['retried']} failed before and retried" if s["retried"] else "")


def print_summary(s: dict, file=sys.stderr) -> None:
    lines = [
        f"requests: {s['ok']} ok, {s['failed']} failed" + _resumed(s),
        f"tokens: {s['prompt_tokens']} prompt, {s['completion_tokens']} completion",
        f"time: {s['wall_s']:.1f} s wall ({s['compile_s']:.1f} s compiling or loading {s['programs']} programs); "
        f"{s['requests_per_s']:.2f} requests/s",
        f"throughput: {s['output_tokens_per_s']:.1f} output tok/s; prefill {s['prefill_tokens_per_s']:.0f} tok/s, "
        f"decode {s['decode_tokens_per_s']:.1f} tok/s",
        f"latency: TTFT p50 {s['ttft_ms_p50']:.0f} ms, p95 {s['ttft_ms_p95']:.0f} ms; slot occupancy "
        f"{100 * s['slot_occupancy']:.0f}% of {s['slots']} slots",
    ]
    lines += [
        f"replica {r['replica']} ({r['node']}, pid {r['pid']}): {r['lines']} lines, {r['output_tok_s']:.1f} output "
        f"tok/s, busy {100 * r['busy_share']:.0f}%, {r['restarts']} restarts"
        for r in s.get("replicas", [])
    ]
    if len(s["hosts"]) > 1:
        lines += [
            f"host {h['process']}: wall {h['wall_s']:.1f} s, prefill {h['prefill_s']:.1f} s, "
            f"decode {h['decode_s']:.1f} s, compile {h['compile_s']:.1f} s"
            for h in s["hosts"]
        ]
    print("\n".join(lines), file=file, flush=True)
