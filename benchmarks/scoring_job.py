"""Writes a scoring job, the shape of lm-evaluation-harness's log-likelihood requests: each line a completion whose
prompt is a few-shot context (`fewshot_job`'s subjects: an instruction and 5 worked examples, then a question) and
one of its 4 answers, `echo` with `max_tokens` 0 and `logprobs` 1, so that the record scores every prompt token and
generates none. A question's 4 lines share their context, a subject's lines its examples.

    python -m benchmarks.scoring_job OUT.jsonl [--questions 64] [--seed 1]
"""

from __future__ import annotations

import json
import random

import fire

from benchmarks.fewshot_job import Subjects


def main(out: str, questions: int = 64, seed: int = 1, subjects: int = 4) -> None:
    drawn = Subjects(random.Random(seed), subjects)
    with open(out, "w") as f:
        for i in range(questions):
            context = f"{drawn.contexts[i % subjects]}\n\n{drawn.question()}"
            for answer in "ABCD":
                line = {
                    "id": f"q{i}{answer}",
                    "prompt": f"{context} {answer}",
                    "max_tokens": 0,
                    "echo": True,
                    "logprobs": 1,
                    "temperature": 0,
                }
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    fire.Fire(main)
