"""What a KV cache's dtype does to a model's next-token distributions: each job line's conversation is answered
greedily with a float32 cache, then that text (prompt + answer) is read again through caches of each dtype, and
every position's distribution is compared with the float32 cache's: mean and largest KL divergence (nats), and
how often the most likely token is the same. XLA's path (the int8 cache's), one device.

    python -m benchmarks.kv_cache_quality [JOB.jsonl] [--model CKPT] [--dtypes bfloat16,float16,int8] [--lines 24]
"""

from __future__ import annotations

from pathlib import Path

import fire
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.divergence import HEADER, answered_texts, row
from jaxllama import LLM
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.model import empty_cache, forward

REPO = Path(__file__).resolve().parent.parent


def main(
    job: str = str(REPO / "jobs" / "eval.jsonl"),
    model: str | None = None,
    dtypes: str = "bfloat16,float16,int8",
    lines: int = 24,
    max_tokens: int = 64,
) -> None:
    llm = LLM.load(model, max_slots=8)
    texts = answered_texts(llm, job, lines, max_tokens)
    config, params = load_checkpoint(llm.path, dtype="float32")
    length = max(len(t) for t in texts)

    @jax.jit
    def logprobs(params, tokens, cache):
        positions = jnp.arange(tokens.shape[1])[None]
        return jax.nn.log_softmax(forward(params, config, tokens, positions, cache)[0][0], axis=-1)

    def read(text, dtype):
        tokens = jnp.asarray(text + [0] * (length - len(text)))[None]
        return np.asarray(logprobs(params, tokens, empty_cache(config, 1, length, jnp.dtype(dtype))))[: len(text)]

    exact = [read(t, "float32") for t in texts]
    print(f"{len(texts)} texts, {sum(map(len, texts))} positions, {Path(llm.path).name}")
    print(f"{'cache':<10} {HEADER}")
    for dtype in dtypes.split(","):
        print(f"{dtype:<10} {row(exact, [read(t, dtype) for t in texts])}")


if __name__ == "__main__":
    fire.Fire(main)
