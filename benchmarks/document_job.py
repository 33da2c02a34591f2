"""Writes a long-document job, the other shape of an evaluation job: each line a document of `words` words (drawn
from `fewshot_job`'s word list, seeded) to summarize, max_tokens 48, greedy. No two lines share more than the chat
template's opening, so every prompt token is computed.

    python -m benchmarks.document_job OUT.jsonl [--lines 32] [--words 1100] [--seed 1]
"""

from __future__ import annotations

import json
import random

import fire

from benchmarks.fewshot_job import WORDS


def main(out: str, lines: int = 32, words: int = 1100, seed: int = 1) -> None:
    rng = random.Random(seed)
    with open(out, "w") as f:
        for i in range(lines):
            document = " ".join(rng.choice(WORDS) for _ in range(words))
            messages = [{"role": "user", "content": f"Summarize this document in two sentences.\n\n{document}"}]
            f.write(json.dumps({"id": f"d{i}", "messages": messages, "max_tokens": 48, "temperature": 0}) + "\n")


if __name__ == "__main__":
    fire.Fire(main)
