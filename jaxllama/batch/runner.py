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

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from jaxllama.batch import records
from jaxllama.batch.jobs import JobLine, read_job
from jaxllama.batch.progress import Progress
from jaxllama.batch.resume import Plan, load_records, plan
from jaxllama.batch.settings import check_settings, record_settings, settings_path
from jaxllama.batch.writer import OrderedWriter, journal_path
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.runtime import broadcast_from_main
from jaxllama.protocol.pipeline import PreparedRequest, RequestPipeline

__all__ = ["JobInterrupted", "JobOptions", "JobStats", "default_output", "print_summary", "read_job", "run_job"]


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
    ttft_ms: list = dataclasses.field(default_factory=list)

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


def run_job(llm, job: Path, output: Path | None = None, options: JobOptions = JobOptions()) -> tuple[JobStats, dict]:
    """Run a job file with a loaded `LLM`. Returns (job statistics, summary dict). Raises SettingsChanged where
    the output was written with other settings, JobInterrupted on Ctrl-C after keeping what finished."""
    o = options
    job = Path(job)
    output = Path(output) if output else default_output(job)
    stats, progress = JobStats(), None
    start = time.perf_counter()
    engine_stats_before = dataclasses.replace(llm.stats)
    try:
        lines = read_job(job)
        stats.requests = len(lines)
        if o.write:
            _prepare_output(output, o.settings, o.overwrite)
        found = _plan(lines, load_records(output) if o.write else {}, o.retry_errors, stats)
        pipeline = RequestPipeline(llm.prompts, o.defaults, tuple(o.stop), o.system_prompt, output_options=False)
        progress = Progress(len(found.todo), quiet=o.quiet, initial_skipped=stats.skipped, retried=stats.retried)
        with OrderedWriter(output if o.write else None, *_order(lines, found)) as writer:
            batch = _JobOnEngine(llm, pipeline, writer, stats, progress)
            for line, duplicate in found.todo:
                if duplicate is None:
                    batch.submit(line)
                else:
                    batch.fail(line, duplicate)
            batch.generate()
    except KeyboardInterrupt:
        raise JobInterrupted(stats.skipped + stats.ok + stats.failed, stats.requests, output) from None
    finally:
        if progress is not None:
            progress.close()
    stats.wall_s = time.perf_counter() - start
    return stats, summary(stats, llm, engine_stats_before)


def _prepare_output(output: Path, settings: dict | None, overwrite: bool) -> None:
    """Start over (`overwrite`), or check that the output was written with these settings; record them."""
    if overwrite:
        for path in (output, journal_path(output), settings_path(output)):
            path.unlink(missing_ok=True)
    elif settings is not None:
        check_settings(output, settings)
    if settings is not None:
        record_settings(output, settings)


def _plan(lines: list[JobLine], done: dict, retry_errors: bool, stats: JobStats) -> Plan:
    """Which lines run, as process 0 (the one that reads the output) decides, on every process; counted in
    `stats`."""
    found = plan(lines, done, retry_errors)
    kept = np.array([line.number in found.kept for line in lines], dtype=np.uint8)
    kept = {line.number for line, k in zip(lines, broadcast_from_main(kept).astype(bool), strict=True) if k}
    found.todo = [(line, duplicate) for line, duplicate in found.todo if line.number not in kept]
    stats.skipped, stats.kept_errors, stats.retried = len(kept), found.kept_errors, found.retried
    return found


def _order(lines: list[JobLine], found: Plan) -> tuple[list[int], dict[int, dict]]:
    """The writer's keys in output order, and the records already known by key: the job's lines by line number,
    then the records kept from earlier runs whose ids no line of this job has (numbered after the last line)."""
    last = lines[-1].number if lines else 0
    others = {last + 1 + i: record for i, record in enumerate(found.others)}
    return [line.number for line in lines] + list(others), {**found.kept, **others}


class _JobOnEngine:
    """The job's requests on the engine: each line submitted or failed at once, then answered as the engine
    finishes it; every record goes to the writer, and is counted in the statistics and the progress."""

    def __init__(self, llm, pipeline: RequestPipeline, writer: OrderedWriter, stats: JobStats, progress: Progress):
        self.llm, self.pipeline, self.writer, self.stats, self.progress = llm, pipeline, writer, stats, progress
        # by line number, the engine's request id: the line, its request, its choices' results as they finish
        self.running: dict[int, tuple[JobLine, PreparedRequest, list]] = {}

    def submit(self, line: JobLine) -> None:
        """Queue a line on the engine, or write its error record if it cannot run."""
        try:
            kind, body = line.request()
            request = self.pipeline.prepare(body, kind)
            # Longest first (by max_tokens): the job then ends with its short requests, rather than with a tail of
            # decode steps that run a few long ones in nearly empty batches. Output stays in file order.
            (one,) = request.text_requests(priority=request.params.max_tokens)
            self.llm.text_engine.submit(line.number, one)
        except Exception as e:  # a line's failure, expected (a RequestError) or not, is its record
            self.fail(line, e)
            return
        self.running[line.number] = (line, request, [None] * request.n)

    def fail(self, line: JobLine, error: Exception) -> None:
        self.writer.put(line.number, records.failure(line, error))
        self.stats.failed += 1
        self.progress.update(ok=False, tokens=0)

    def generate(self) -> None:
        """Step the engine until every submitted line is answered."""
        model_name = self.llm.name
        while self.llm.text_engine.has_work():
            for event in self.llm.text_engine.step():
                if event.result is None:
                    continue
                line, request, results = self.running[event.id]
                results[event.index] = event.result
                if not event.last:
                    continue
                del self.running[event.id]
                error = next((r.error for r in results if r.error is not None), None)
                if error is not None:  # its grammar could not be followed to the end: no answer
                    self.fail(line, error)
                    continue
                try:
                    answer = results if request.n > 1 else results[0]
                    record = records.success(line, request, answer, model_name, self.llm.tokenizer)
                except Exception as e:  # one line's fault costs that line only
                    self.fail(line, e)
                    continue
                self.writer.put(line.number, record)
                tokens = sum(len(r.token_ids) for r in results)
                self.stats.ok += 1
                self.stats.prompt_tokens += results[0].prompt_tokens
                self.stats.completion_tokens += tokens
                self.stats.ttft_ms.append(results[0].timings.ttft_ms)
                self.progress.update(ok=True, tokens=tokens)


def summary(stats: JobStats, llm, before) -> dict:
    e = llm.stats
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
        "kept_errors": stats.kept_errors,
        "retried": stats.retried,
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
        "slot_occupancy": round(slot_steps / max(1, steps * llm.slots), 3),
        "decode_steps": steps,
        "slots": llm.slots,
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
    if len(s["hosts"]) > 1:
        lines += [
            f"host {h['process']}: wall {h['wall_s']:.1f} s, prefill {h['prefill_s']:.1f} s, "
            f"decode {h['decode_s']:.1f} s, compile {h['compile_s']:.1f} s"
            for h in s["hosts"]
        ]
    print("\n".join(lines), file=file, flush=True)
