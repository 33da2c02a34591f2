"""A job on replicas over Ray against one process, and the driver's own speed and memory.

    python -m benchmarks.ray_job job JOB.jsonl [--replicas 2] [--model CKPT] [--rounds 1]
    python -m benchmarks.ray_job driver [--lines 1000000] [--replicas 100] [--block 64]

`job`: `jaxllama run JOB` on this host's cores, then `jaxllama run JOB --ray local --replicas N` (each replica its
share of the cores), alternating, each run warm (a first, untimed run of each fills the compilation cache); each
run's whole command timed, and its `--stats-file` `wall_s` (for Ray: less the seconds starting its replicas). The
records of the two compared, less their timings and cached-token counts (what a process's cache held).

`driver`: a job of `lines` one-word lines answered by replicas that answer at once (no model), so that what is
timed is the driver alone: reading the job, sending blocks, writing records in order; lines/s and the driver's
peak resident memory.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parent.parent


def _run(job: Path, out: Path, extra: list[str], model: str | None) -> tuple[float, dict]:
    stats = out.with_suffix(".stats.json")
    command = [sys.executable, "-m", "jaxllama.cli", "run", str(job), "--output", str(out), "--overwrite"]
    command += ["--stats-file", str(stats), "--quiet", *(["--model", model] if model else []), *extra]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return seconds, json.loads(stats.read_text())


def _records(path: Path) -> list[dict]:
    """The records, less what depends on the process that answered: timings, and the prompt tokens its cache held."""
    out = []
    for text in path.read_text().splitlines():
        record = {k: v for k, v in json.loads(text).items() if k != "timings"}
        if "usage" in record:
            record["usage"] = {k: v for k, v in record["usage"].items() if k != "prompt_tokens_details"}
        out.append(record)
    return out


def job(job: str, replicas: int = 2, model: str | None = None, rounds: int = 1) -> None:
    job_path = Path(job)
    with tempfile.TemporaryDirectory() as tmp:
        one, many = Path(tmp) / "one.jsonl", Path(tmp) / "many.jsonl"
        ways = {"1 process": [], f"{replicas} replicas": ["--ray", "local", "--replicas", str(replicas)]}
        for extra in ways.values():  # warm: the programs compiled into the cache once
            _run(job_path, one, extra, model)
        rows = {name: [] for name in ways}
        for _ in range(rounds):
            for (name, extra), out in zip(ways.items(), (one, many), strict=True):
                seconds, stats = _run(job_path, out, extra, model)
                rows[name].append((seconds, stats["wall_s"] - stats.get("replicas_loaded_s", 0.0), stats))
        same = _records(one) == _records(many)
    lines = rows["1 process"][0][2]["requests"]
    print(f"{job_path.name}: {lines} lines; records equal: {same}")
    for name, runs in rows.items():
        for seconds, wall, stats in runs:
            print(
                f"{name:<12} command {seconds:7.1f} s  job {wall:7.1f} s  "
                f"{stats['output_tokens_per_s']:8.1f} output tok/s"
            )
            for r in stats.get("replicas", []):
                print(f"    replica {r['replica']}: {r['lines']} lines, busy {100 * r['busy_share']:.0f}%")
    (a, *_), (b, *_) = (sorted(r[1] for r in runs) for runs in rows.values())
    (c, *_), (d, *_) = (sorted(r[0] for r in runs) for runs in rows.values())
    print(f"job time, replicas / one process: {b / a:.3f}; whole commands: {d / c:.3f}")


class Instant:
    """A replica that answers every line at once, without a model."""

    def __init__(self, spec, options):
        pass

    def describe(self) -> dict:
        import os

        return {"node": "here", "pid": os.getpid(), "devices": "none"}

    def answer(self, lines):
        import os

        from jaxllama.batch.runner import Answered

        return (
            [Answered(line.number, {"id": line.id, "text": "ok"}, True, 1, 1, 0.0) for line in lines],
            os.getpid(),
            0.0,
        )

    def engine_stats(self):
        from jaxllama.engine.stats import EngineStats

        return EngineStats(), 0


def driver(lines: int = 1_000_000, replicas: int = 100, block: int = 64) -> None:
    import ray
    import ray.cloudpickle

    from jaxllama.batch.runner import JobOptions
    from jaxllama.ray import ReplicaSpec, run_job_on_ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=replicas, include_dashboard=False, logging_level="ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        job_path = Path(tmp) / "job.jsonl"
        with open(job_path, "w") as f:  # a line at a time: the driver's peak is its own, not the file's text
            for i in range(lines):
                f.write(f'{{"id": "l{i}", "prompt": "hi", "max_tokens": 1}}\n')
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        start = time.perf_counter()
        stats, summary = run_job_on_ray(
            job_path, Path(tmp) / "out.jsonl", JobOptions(quiet=True), ReplicaSpec(), replicas, None, block, Instant
        )
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    fed = seconds - summary["replicas_loaded_s"]
    print(
        f"{lines:,} lines on {replicas} instant replicas, blocks of {block}: {seconds:.1f} s, of which "
        f"{summary['replicas_loaded_s']:.1f} s starting the replicas; {lines / fed:,.0f} lines/s once they run; "
        f"driver peak RSS {peak:,.0f} MB ({before:,.0f} MB before the job)"
    )
    assert stats.ok == lines


if __name__ == "__main__":
    fire.Fire({"job": job, "driver": driver})
