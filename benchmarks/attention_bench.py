"""A prompt's attention through the CPU attention kernel alone (`backends/cpu/decode_attention.cc`), as a share of
this CPU's peak (`benchmarks.peaks`, measured first in the same run) for the arithmetic its scores and weighted
values run on: float32 FMAs, or bfloat16 pairs (vdpbf16ps) over a bfloat16 cache on a CPU with AVX-512 BF16. One
prompt of each length in `--prompts` from position 0, every query seeing the positions up to its own, at a model's
heads (SmolLM2's by default: 3 KV heads of 3 query heads, 64 dims) over a cache of `--cache` (float16, the CPU
kernels' default, bfloat16 or float32). GFLOP/s count the causal products only (2 x 2 x head dims per query and
position it sees), not the softmax; the best of `--repeat` calls.

`--decode ROWS`: a decode step's shape instead, ROWS rows of one query each, each over its own slot of as many
positions as the prompt's length; as its bound is the cache's bytes, GB/s of keys and values read, against a
streaming copy's (`measure.memory_bandwidth`, in the same run). `--capacity N`: each slot holds N positions, of
which the first (the prompt's length) are read, as in an engine whose cache has grown for a longer request: the
transposed keys' dims then lie N positions apart.

    python -m benchmarks.attention_bench [--prompts 512,1024,2048] [--kv 3] [--groups 3] [--head-dim 64]
                                         [--cache float16|bfloat16|float32] [--repeat 10] [--decode 64]
                                         [--capacity 4096]
"""

from __future__ import annotations

import time

import fire
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import peaks
from benchmarks.matmul_bench import _list
from benchmarks.measure import memory_bandwidth
from jaxllama.backends.cpu import library
from jaxllama.backends.cpu.decode_attention import decode_attention
from jaxllama.engine.runtime import cache_dir


def main(
    prompts: str = "512,1024,2048",
    kv: int = 3,
    groups: int = 3,
    head_dim: int = 64,
    cache: str = "float16",
    repeat: int = 10,
    decode: int = 0,
    capacity: int = 0,
):
    if not library.load(cache_dir() / "kernels"):
        raise SystemExit("the CPU kernels could not be built")
    pairs = jnp.dtype(cache) == jnp.bfloat16 and library.attends_in_bfloat16(head_dim)
    form = "bf16_pairs" if pairs else "float32_fma"
    peak = peaks.measure()[form]
    print(f"{form} peak, from registers on every core: {peak:.0f} GFLOP/s")
    print(
        f"{kv} KV heads x {groups} query heads, {head_dim} dims, a {cache} cache: prompt tokens, ms, GFLOP/s, % of peak"
    )
    attend = jax.jit(decode_attention)
    rng = np.random.default_rng(0)
    if decode:
        bandwidth = memory_bandwidth() / 1e9
        held = f", each slot holding {capacity}" if capacity else ""
        print(
            f"{decode} rows decoding{held}; a streaming copy {bandwidth:.1f} GB/s: positions, ms, GB/s of keys and"
            " values read"
        )
        for t in map(int, _list(prompts)):
            q = jnp.asarray(rng.standard_normal((decode, kv, groups, head_dim)), jnp.float32)
            n = max(t, capacity)
            keys = jnp.asarray(rng.standard_normal((decode, kv, head_dim, n)), cache)
            values = jnp.asarray(rng.standard_normal((decode, kv, n, head_dim)), cache)
            slots, positions = jnp.arange(decode, dtype=jnp.int32), jnp.full(decode, t - 1, jnp.int32)
            best = _best(attend, (q, keys, values, slots, positions), repeat)
            rate = (keys.nbytes + values.nbytes) * t / n / best / 1e9
            print(f"{t:>6} {best * 1e3:8.3f} {rate:7.1f} {100 * rate / bandwidth:4.0f}%", flush=True)
        return
    for t in map(int, _list(prompts)):
        q = jnp.asarray(rng.standard_normal((t, kv, groups, head_dim)), jnp.float32)
        keys = jnp.asarray(rng.standard_normal((1, kv, head_dim, t)), cache)
        values = jnp.asarray(rng.standard_normal((1, kv, t, head_dim)), cache)
        slots, positions = jnp.zeros(t, jnp.int32), jnp.arange(t, dtype=jnp.int32)
        best = _best(attend, (q, keys, values, slots, positions), repeat)
        flop = 2 * 2 * (t * (t + 1) / 2) * kv * groups * head_dim
        rate = flop / best / 1e9
        print(f"{t:>6} {best * 1e3:8.2f} {rate:7.1f} {100 * rate / peak:4.0f}%", flush=True)


def _best(attend, args, repeat: int) -> float:
    """The fastest of `repeat` calls, in seconds, after one to compile."""
    attend(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        attend(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    fire.Fire(main)
