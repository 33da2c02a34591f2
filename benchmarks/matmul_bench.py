"""The CPU matmul kernel alone at SmolLM2's product shapes: ms per call and GFLOP/s for float32 and int8 (q8_0)
panels, against numpy's (OpenBLAS) product of the same shape, each call timed in a jitted chain of `repeat` calls.

    python -m benchmarks.matmul_bench [--rows 1,32,64,512] [--repeat 20]
"""

from __future__ import annotations

import time

import fire
import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.engine.runtime import cache_dir
from jaxllama.kernels import library, matmul

# SmolLM2-135M: q/k/v as one product, o, gate/up as one gated product, down, the output layer.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 1536), "down": (1536, 576), "output": (576, 49152)}


def _time(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _chain(w: matmul.Packed, repeat: int):
    """x -> repeat products of x by w, each depending on the last (the outputs summed back onto x's width)."""

    def run(x):
        for _ in range(repeat):
            y = matmul.matmul(x, w)
            x = x + y[..., : x.shape[-1]] * 1e-3 if y.shape[-1] >= x.shape[-1] else x + jnp.mean(y) * 1e-3
        return x

    return jax.jit(run)


def _list(value) -> list[str]:
    """A comma-separated flag as fire passes it: a string, a number or a tuple."""
    return [str(v) for v in value] if isinstance(value, (tuple, list)) else str(value).split(",")


def main(rows: str = "1,32,64,512", repeat: int = 20, shapes: str = ",".join(SHAPES)):
    if not library.load(cache_dir() / "kernels"):
        raise SystemExit("the CPU kernels could not be built")
    rng = np.random.default_rng(0)
    head = ("shape", "rows", "f32 ms", "GFLOP/s", "q8_0 ms", "GOP/s", "numpy ms", "GFLOP/s")
    print("{:>8} {:>5} | {:>8} {:>8} | {:>8} {:>8} | {:>8} {:>8}".format(*head))
    for name in _list(shapes):
        n_in, n_out = SHAPES[name]
        w = jnp.asarray(rng.standard_normal((2 * n_out if name == "gate_up" else n_out, n_in), np.float32) * 0.02)
        packed = matmul.pack_gated(w[:n_out], w[n_out:]) if name == "gate_up" else matmul.pack(w)
        quantized = matmul.quantize(packed)
        wn = np.asarray(w).T.copy()
        for m in map(int, _list(rows)):
            x = jnp.asarray(rng.standard_normal((m, n_in), np.float32))
            flop = 2 * m * wn.shape[0] * wn.shape[1]
            f32 = _time(_chain(packed, repeat), x) / repeat
            q8 = _time(_chain(quantized, repeat), x) / repeat
            xn = np.asarray(x)
            ref = _time(lambda xn=xn, wn=wn: [xn @ wn for _ in range(repeat)]) / repeat
            times = (f32 * 1e3, flop / f32 / 1e9, q8 * 1e3, flop / q8 / 1e9, ref * 1e3, flop / ref / 1e9)
            print("{:>8} {:>5} | {:8.3f} {:8.1f} | {:8.3f} {:8.1f} | {:8.3f} {:8.1f}".format(name, m, *times))


if __name__ == "__main__":
    fire.Fire(main)
