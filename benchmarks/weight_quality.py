"""What the form the CPU kernels read the weights in does to the default model's next-token distributions. Each job
line's conversation is answered greedily by the model in float32 (the GGUF's own weights, dequantized exactly), then
that text (prompt + answer) is read again (`LLM.logits`) with the weights in each form, and every position's
distribution is compared with float32's: mean and largest KL divergence (nats), and how often the most likely token
is the same. The forms: "default" (the default conversion: Q8_0 blocks, inputs kept exact in int16), "w8a8" (the same
blocks times inputs rounded to int8 per block of 32, as llama.cpp's Q8_0 products), "bfloat16".

    python -m benchmarks.weight_quality [JOB.jsonl] [--model GGUF] [--forms default,w8a8,bfloat16] [--lines 24]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import fire
import numpy as np

from benchmarks.divergence import HEADER, answered_texts, row
from converters.llama import convert
from jaxllama import LLM
from jaxllama.default_model import default_gguf

REPO = Path(__file__).resolve().parent.parent


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(
    job: str = str(REPO / "jobs" / "eval.jsonl"),
    model: str | None = None,
    forms: str = "default,w8a8,bfloat16",
    lines: int = 24,
    max_tokens: int = 64,
) -> None:
    gguf = Path(model) if model else default_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        exact = LLM.load(convert(gguf, Path(tmp) / "f32", dtype="float32", progress=False), max_slots=8)
        default = convert(gguf, Path(tmp) / "default", progress=False)
        texts = answered_texts(exact, job, lines, max_tokens)
        reference = [_log_softmax(x[: len(t)]) for x, t in zip(exact.logits(texts), texts, strict=True)]
        print(f"{len(texts)} texts, {sum(map(len, texts))} positions, {gguf.name}")
        print(f"{'weights':<10} {HEADER}")
        for form in forms.split(","):
            options = {"default": {}, "bfloat16": {"dtype": "bfloat16"}}.get(form, {"quantize": form})
            llm = LLM.load(default if form != "bfloat16" else exact.path, max_slots=8, **options)
            got = [_log_softmax(x[: len(t)]) for x, t in zip(llm.logits(texts), texts, strict=True)]
            print(f"{form:<10} {row(reference, got)}")


if __name__ == "__main__":
    fire.Fire(main)
