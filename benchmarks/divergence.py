"""What the quality benchmarks share (`kv_cache_quality.py`, `weight_quality.py`): a job's conversations answered
greedily as texts to read again, and how far each position's next-token distribution is from a reference's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HEADER = f"{'mean KL':>10} {'max KL':>10} {'top-1 same':>11}"


def answered_texts(llm, job: str | Path, lines: int, max_tokens: int) -> list[list[int]]:
    """The first `lines` conversations of a job file, each with `llm`'s greedy answer, as token ids."""
    records = [json.loads(line) for line in Path(job).read_text().splitlines()]
    records = [r.get("body", r) for r in records][:lines]  # OpenAI Batch lines carry the request as their body
    conversations = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in records]
    answers = llm.chat(conversations, max_tokens=max_tokens, temperature=0)
    return [llm.encode_chat(c) + a.token_ids for c, a in zip(conversations, answers, strict=True)]


def row(reference: list[np.ndarray], got: list[np.ndarray]) -> str:
    """Mean and largest KL(reference || got) over every position (log-probabilities [positions, vocab] per text),
    and how often the most likely token is the same, as a line under HEADER."""
    kl = np.concatenate([np.sum(np.exp(e) * (e - g), axis=-1) for e, g in zip(reference, got, strict=True)])
    same = np.concatenate([np.argmax(e, -1) == np.argmax(g, -1) for e, g in zip(reference, got, strict=True)])
    return f"{kl.mean():>10.2e} {kl.max():>10.2e} {same.mean():>10.2%}"
