"""Two versions of jaxllama on the same jobs, in one run: does a change keep (or improve) the speed?

    python -m benchmarks.compare_commits BASE JOB.jsonl [JOB.jsonl ...] [--new REV] [--rounds 2]
                                         [--options "--quantize w8a8"]

BASE (and NEW, by default the working tree) are git revisions (e.g. `HEAD~3`, a commit id), each checked out into a
temporary worktree. Each version runs each job through `jaxllama run` with its own compilation cache: once cold
(not counted: it fills the cache), then `rounds` times warm, the two versions alternating so that a machine whose
speed drifts affects both alike. Prints each warm run's output tokens/s and the ratio of the medians (working tree
over BASE; of the inverse wall times for a job that generates nothing, such as scoring).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]


def run_job(tree: Path, cache: Path, job: Path, options: list[str]) -> dict:
    """`jaxllama run` of the version in `tree` (its own source first on the path), and its summary."""
    out, stats = cache / "out.jsonl", cache / "stats.json"
    cmd = [sys.executable, "-m", "jaxllama.cli", "run", str(job), "--output", str(out), "--overwrite", "--quiet"]
    cmd += ["--stats-file", str(stats), *options]
    env = {**os.environ, "JAXLLAMA_CACHE": str(cache), "PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads(stats.read_text())


@contextlib.contextmanager
def worktrees(base: str, new: str | None, tmp: Path):
    """{"base": a worktree of `base`, "new": one of `new` (None: this repository as it is)}, removed after."""
    trees = {"base": tmp / "base", "new": tmp / "new" if new else REPO}
    for name, rev in (("base", base), ("new", new)):
        if rev:
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[name]), rev], cwd=REPO, check=True)
    try:
        yield trees
    finally:
        for tree in trees.values():
            if tree != REPO:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)


def main(base: str, *jobs: str, new: str | None = None, rounds: int = 2, options: str = ""):
    flags = shlex.split(options)
    jobs = [Path(j).resolve() for j in jobs]
    with tempfile.TemporaryDirectory() as tmp, worktrees(base, new, Path(tmp)) as trees:
        tmp = Path(tmp)
        for job in jobs:
            runs, walls = {name: [] for name in trees}, {name: [] for name in trees}
            for name, tree in trees.items():  # cold: fills each version's cache
                run_job(tree, tmp / f"cache-{name}", job, flags)
            for i in range(rounds):
                for name, tree in trees.items() if i % 2 == 0 else reversed(trees.items()):
                    stats = run_job(tree, tmp / f"cache-{name}", job, flags)
                    runs[name].append(stats["output_tokens_per_s"])
                    walls[name].append(stats["wall_s"])
                    print(
                        f"{job.name} {name}: {stats['output_tokens_per_s']:.1f} output tok/s, "
                        f"wall {stats['wall_s']:.1f} s",
                        flush=True,
                    )
            if all(runs["base"]) and all(runs["new"]):
                ratio, of = statistics.median(runs["new"]) / statistics.median(runs["base"]), "output tok/s"
            else:  # a job that generates nothing (scoring): its speed is the inverse of its wall time
                ratio, of = statistics.median(walls["base"]) / statistics.median(walls["new"]), "1 / wall"
            label = f"{new or 'working tree'} / {base}"
            print(f"{job.name}: {label} = {ratio:.3f} ({of}, medians of {rounds} warm runs)")


if __name__ == "__main__":
    fire.Fire(main)
