"""Run a job file: every line answered, in input order, each written and flushed as soon as it and all lines
before it are done; resumable (ids already in the output are skipped); bad lines become error records.

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
from jaxllama.batch.jobs import JobLine, LineError, line_id, parse_line
from jaxllama.batch.progress import Progress
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.runtime import broadcast_from_main
from jaxllama.protocol.requests import submit_error


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
    try:
        lines = job.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise OSError(f"{job}: cannot read the job file ({e})") from None
    if overwrite and write and output.exists():
        output.unlink()
    done = completed_ids(output) if write else set()
    # Only the writing process (process 0) reads the output; every process skips the lines it skips.
    skip = _skipped_lines(lines, done)

    stats = JobStats()
    start = time.perf_counter()
    engine_stats_before = dataclasses.replace(llm.engine.stats)
    todo: list[tuple[int, dict | None]] = []  # (line number, record if already known)
    seen_ids = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        stats.requests += 1
        rid = line_id(raw, number)
        if skip[number - 1]:
            stats.skipped += 1
            continue
        if rid in seen_ids:
            openai = '"custom_id"' in raw
            todo.append(
                (
                    number,
                    records.failure(
                        LineError("duplicate_id", f"id {rid!r} is used by an earlier line", number), rid, openai
                    ),
                )
            )
            continue
        seen_ids.add(rid)
        todo.append((number, None))

    progress = Progress(total=len(todo), quiet=quiet, initial_skipped=stats.skipped)
    out = open(output, "a", encoding="utf-8") if write else None
    pending: dict[int, dict] = {}  # line number -> finished record, waiting for earlier lines
    order = [number for number, _ in todo]
    next_index = 0

    def flush():
        nonlocal next_index
        while next_index < len(order) and order[next_index] in pending:
            record = pending.pop(order[next_index])
            if out:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
            next_index += 1

    def finish(number, record, ok, result=None):
        pending[number] = record
        if ok:
            stats.ok += 1
            stats.prompt_tokens += result.prompt_tokens
            stats.completion_tokens += len(result.token_ids)
            stats.ttft_ms.append(result.timings.ttft_ms)
        else:
            stats.failed += 1
        progress.update(ok=ok, tokens=len(result.token_ids) if result else 0)

    jobs: dict[int, JobLine] = {}
    try:
        for number, known in todo:
            if known is not None:
                finish(number, known, ok=False)
                continue
            raw = lines[number - 1]
            try:
                line = parse_line(raw, number, defaults, stop, system_prompt)
                prompt = llm.encode_chat(line.messages) if line.kind == "chat" else llm.encode(line.prompt)
                # Longest first (by max_tokens): the job's last requests are then short ones, and its tail of
                # nearly empty decode steps is short (job256: 304 s against 340 in file order). Output stays in
                # file order.
                llm.generation.submit(number, prompt, line.params, line.stop, priority=line.params.max_tokens)
                jobs[number] = line
            except LineError as e:
                finish(number, records.failure(e, line_id(raw, number), '"custom_id"' in raw), ok=False)
            except ValueError as e:  # ChatTemplateError is a ValueError too
                error = submit_error(e, line.kind)
                error = LineError(error.code, error.message, number)
                finish(number, records.failure(error, line_id(raw, number), '"custom_id"' in raw), ok=False)
            flush()
        model_name = llm.path.name if llm.path else "jaxllama"
        while llm.generation.has_work():
            for event in llm.generation.step():
                if event.result is None:
                    continue
                line = jobs.pop(event.id)
                finish(event.id, records.success(line, event.result, model_name), ok=True, result=event.result)
            flush()
        flush()
    finally:
        if out:
            out.close()
        progress.close()
    stats.wall_s = time.perf_counter() - start
    return stats, summary(stats, llm, engine_stats_before)


def _skipped_lines(lines: list[str], done: set) -> np.ndarray:
    """Per line: already answered (its id in `done`), as process 0 sees it, on every process."""
    skip = np.array([bool(raw.strip()) and line_id(raw, n) in done for n, raw in enumerate(lines, start=1)])
    return broadcast_from_main(skip.astype(np.uint8)).astype(bool)


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
