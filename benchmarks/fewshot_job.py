"""Writes a few-shot multiple-choice job, the shape of an evaluation job: lines of 4 subjects in turn, each line's
system message its subject's instruction and 5 worked examples (the same for every line of the subject: a prefix
to reuse), then a question, max_tokens 8, greedy. Words are drawn from a fixed list, seeded.

    python -m benchmarks.fewshot_job OUT.jsonl [--lines 128] [--seed 1]
"""

from __future__ import annotations

import json
import random

import fire

WORDS = (
    "the of and a to in is that it was for on are as with his they at be this have from or one had by word but not "
    "what all were we when your can said there use an each which she do how their if will up other about out many "
    "then them these so some her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come made may part"
).split()


class Subjects:
    """Text drawn from `rng`: questions (45 words and 4 options of 4, "Answer:" last) and `count` subjects' few-shot
    contexts (`contexts`: an instruction of 160 words and 5 answered questions each)."""

    def __init__(self, rng: random.Random, count: int):
        self.rng = rng
        self.contexts = [
            f"You are an expert in subject {s}. {self.text(160)}\n\n"
            + "\n\n".join(f"{self.question()} {rng.choice('ABCD')}" for _ in range(5))
            for s in range(count)
        ]

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def question(self) -> str:
        return f"Question: {self.text(45)}?\n" + "\n".join(f"{c}) {self.text(4)}" for c in "ABCD") + "\nAnswer:"


def main(out: str, lines: int = 128, seed: int = 1, subjects: int = 4) -> None:
    drawn = Subjects(random.Random(seed), subjects)
    with open(out, "w") as f:
        for i in range(lines):
            system, question = drawn.contexts[i % subjects], drawn.question()
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            f.write(json.dumps({"id": f"q{i}", "messages": messages, "max_tokens": 8, "temperature": 0}) + "\n")


if __name__ == "__main__":
    fire.Fire(main)
