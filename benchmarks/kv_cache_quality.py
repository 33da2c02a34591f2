"""What a KV cache's dtype does to a model's next-token distributions: each job line's conversation is answered
greedily with a float32 cache, then that text (prompt + answer) is read again through caches of each dtype, and
every position's distribution is compared with the float32 cache's: mean and largest KL divergence (nats), and
how often the most likely token is the same. XLA's path (the int8 cache's), one device, on the checkpoint's float32
weights; or, with `--kernels`, the CPU kernels on the weights as they run them by default (their attention over a
bfloat16 cache, on a CPU with AVX-512 BF16, computes in bfloat16: `backends/cpu/decode_attention.cc`).

    python -m benchmarks.kv_cache_quality [JOB.jsonl] [--model CKPT] [--dtypes bfloat16,float16,int8] [--lines 24]
                                          [--kernels]
"""

from __future__ import annotations

from pathlib import Path

import fire
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.divergence import HEADER, answered_texts, row
from benchmarks.matmul_bench import _list
from jaxllama import LLM
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.model import empty_cache, forward
from jaxllama.core.ops import XLA

REPO = Path(__file__).resolve().parent.parent


def main(
    job: str = str(REPO / "jobs" / "eval.jsonl"),
    model: str | None = None,
    dtypes: str = "bfloat16,float16,int8",
    lines: int = 24,
    max_tokens: int = 64,
    kernels: bool = False,
) -> None:
    llm = LLM.load(model, max_slots=8)
    texts = answered_texts(llm, job, lines, max_tokens)
    if kernels:
        if not isinstance(llm.engine.ops, CpuOps):
            raise SystemExit("--kernels: the CPU kernels are not in use here")
        config, params, ops = llm.config, llm.params, llm.engine.ops
    else:
        (config, params), ops = load_checkpoint(llm.path, dtype="float32"), XLA
    length = max(len(t) for t in texts)

    @jax.jit
    def logprobs(params, tokens, cache):
        positions = jnp.arange(tokens.shape[1])[None]
        return jax.nn.log_softmax(forward(params, config, tokens, positions, cache, ops=ops)[0][0], axis=-1)

    def read(text, dtype):
        tokens = jnp.asarray(text + [0] * (length - len(text)))[None]
        cache = empty_cache(config, 1, length, jnp.dtype(dtype), ops=ops)
        return np.asarray(logprobs(params, tokens, cache))[: len(text)]

    exact = [read(t, "float32") for t in texts]
    print(f"{len(texts)} texts, {sum(map(len, texts))} positions, {Path(llm.path).name}")
    print(f"{'cache':<10} {HEADER}")
    for dtype in _list(dtypes):
        print(f"{dtype:<10} {row(exact, [read(t, dtype) for t in texts])}")


if __name__ == "__main__":
    fire.Fire(main)
