"""What a KV cache's dtype does to a model's next-token distributions: each job line's conversation is answered
greedily with a float32 cache, then that text (prompt + answer) is read again through caches of each dtype, and
every position's distribution is compared with the float32 cache's: mean and largest KL divergence (nats), and
how often the most likely token is the same. XLA's path (the int8 cache's), one device.

    python -m benchmarks.kv_cache_quality [JOB.jsonl] [--model CKPT] [--dtypes bfloat16,float16,int8] [--lines 24]
"""

from __future__ import annotations

import json
from pathlib import Path

import fire
import jax
import jax.numpy as jnp
import numpy as np

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
    records = [json.loads(line) for line in Path(job).read_text().splitlines()]
    records = [r.get("body", r) for r in records][:lines]  # OpenAI Batch lines carry the request as their body
    conversations = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in records]
    answers = llm.chat(conversations, max_tokens=max_tokens, temperature=0)
    texts = [llm.encode_chat(c) + a.token_ids for c, a in zip(conversations, answers, strict=True)]
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
    print(f"{'cache':<10} {'mean KL':>10} {'max KL':>10} {'top-1 same':>11}")
    for dtype in dtypes.split(","):
        kl, same = [], []
        for e, text in zip(exact, texts, strict=True):
            got = read(text, dtype)
            kl.append(np.sum(np.exp(e) * (e - got), axis=-1))
            same.append(np.argmax(e, -1) == np.argmax(got, -1))
        kl, same = np.concatenate(kl), np.concatenate(same)
        print(f"{dtype:<10} {kl.mean():>10.2e} {kl.max():>10.2e} {same.mean():>10.2%}")


if __name__ == "__main__":
    fire.Fire(main)
