"""lm-evaluation-harness's log-likelihood requests through `jaxllama serve`, two versions in one run: how long an
MMLU-shaped task takes, as its user runs it.

    python -m benchmarks.lm_eval_bench BASE [--new REV] [--subjects 2] [--questions 32] [--rounds 2]
                                       [--batch-size 16]

Writes a task folder of `subjects` tasks shaped as MMLU's: each subject's instruction (the task's description) and
5 worked examples (its dev split, taken first_n) are the same for every one of its `questions` questions, and each
question's 4 choices (" A" ... " D") are scored by their log-likelihood: 4 x subjects x questions requests, each a
~650-token context and a 1-token continuation. Text from `fewshot_job`'s word list, seeded.

BASE (and NEW, by default the working tree) each serve the default model from their own worktree
(`compare_commits.worktrees`) and compilation cache, both at once on two ports; `lm_eval --model local-completions`
(lm-evaluation-harness's commands as README.md gives them, `pip install -e '.[eval]'`) runs against each once cold
(not counted: it compiles), then `rounds` times warm, the versions alternating. Prints each run's wall time (lm_eval's
whole process: its own start and tokenizing included) and the ratio of the medians, BASE over NEW, and each
version's accuracy per task (random text: only whether the two agree says anything).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import fire

from benchmarks.compare_commits import worktrees
from benchmarks.fewshot_job import Subjects
from benchmarks.server_bench import serving

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    dev: {dev}
    test: {test}
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
num_fewshot: 5
description: {description}
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path, subjects: int, questions: int, seed: int = 1) -> list[str]:
    """The task folder for `lm_eval --include_path`; returns the task names."""
    drawn = Subjects(random.Random(seed), 0)
    names = []
    for s in range(subjects):
        name = f"jaxllama_bench_s{s}"
        for split, n in (("dev", 5), ("test", questions)):
            rows = [{"question": drawn.question(), "answer": drawn.rng.randrange(4)} for _ in range(n)]
            (folder / f"{name}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        description = json.dumps(f"You are an expert in subject {s}. {drawn.text(160)}\n\n")
        dev, test = folder / f"{name}_dev.jsonl", folder / f"{name}_test.jsonl"
        (folder / f"{name}.yaml").write_text(TASK.format(name=name, dev=dev, test=test, description=description))
        names.append(name)
    return names


def run_lm_eval(url: str, tasks: list[str], folder: Path, batch_size: int, out: Path) -> tuple[float, dict]:
    """lm_eval's wall seconds over the tasks, through the server at `url`, and its accuracy per task."""
    args = f"base_url={url}/v1/completions,model=jaxllama,num_concurrent=1,max_length=2048"
    cmd = ["lm_eval", "--model", "local-completions", "--model_args", args, "--batch_size", str(batch_size)]
    cmd += ["--tasks", ",".join(tasks), "--include_path", str(folder), "--output_path", str(out)]
    start = time.perf_counter()
    subprocess.run(cmd, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())["results"]
    return wall, {task: round(r["acc,none"], 4) for task, r in results.items()}


def main(
    base: str,
    new: str | None = None,
    subjects: int = 2,
    questions: int = 32,
    rounds: int = 2,
    batch_size: int = 16,
    port: int = 8741,
):
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        (tmp / "tasks").mkdir()
        tasks = write_tasks(tmp / "tasks", subjects, questions)
        trees = stack.enter_context(worktrees(base, new, tmp))
        urls = {}
        for i, (name, tree) in enumerate(trees.items()):
            cmd = [sys.executable, "-m", "jaxllama.cli", "serve", "--port", str(port + i)]
            cmd += ["--max-context", "2048", "--max-batch", str(batch_size)]
            env = {**os.environ, "JAXLLAMA_CACHE": str(tmp / f"cache-{name}"), "PYTHONPATH": str(tree)}
            urls[name] = stack.enter_context(serving(cmd, port + i, cwd=tree, env=env))
        for name, url in urls.items():  # cold: compiles each version's programs
            _, accuracy = run_lm_eval(url, tasks, tmp / "tasks", batch_size, tmp / f"out-{name}")
            print(f"{name}: accuracy {accuracy}", flush=True)
        walls = {name: [] for name in urls}
        for i in range(rounds):
            for name, url in urls.items() if i % 2 == 0 else reversed(urls.items()):
                wall, _ = run_lm_eval(url, tasks, tmp / "tasks", batch_size, tmp / f"out-{name}")
                walls[name].append(wall)
                print(f"{name}: lm_eval {wall:.1f} s", flush=True)
        requests = 4 * subjects * questions
        ratio = statistics.median(walls["base"]) / statistics.median(walls["new"])
        label = f"{new or 'working tree'} / {base}"
        print(f"{requests} log-likelihood requests: {label} = {ratio:.3f} (1 / lm_eval's wall, medians of {rounds})")


if __name__ == "__main__":
    fire.Fire(main)
