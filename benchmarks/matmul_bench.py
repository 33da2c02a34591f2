"""The CPU matmul kernel alone at SmolLM2's product shapes: ms per call and G(FL)OP/s for float32 panels and each
quantized format (`matmul.QUANTIZATIONS`), against numpy's (OpenBLAS) product of the same shape, each call timed in
a jitted chain of `repeat` calls.

    python -m benchmarks.matmul_bench [--rows 1,32,64,512] [--repeat 20]
"""

from __future__ import annotations

import time

import fire
import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.backends.cpu import library, matmul
from jaxllama.engine.runtime import cache_dir

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
    formats = ("float32", *matmul.QUANTIZATIONS, "numpy")
    print(f"{'shape':>8} {'rows':>5}" + "".join(f" | {name + ' ms':>12} {'G(FL)OP/s':>9}" for name in formats))
    for name in _list(shapes):
        n_in, n_out = SHAPES[name]
        w = jnp.asarray(rng.standard_normal((2 * n_out if name == "gate_up" else n_out, n_in), np.float32) * 0.02)
        packed = matmul.pack_gated(w[:n_out], w[n_out:]) if name == "gate_up" else matmul.pack(w)
        products = [packed, *(matmul.quantize(packed, name) for name in matmul.QUANTIZATIONS)]
        wn = np.asarray(w).T.copy()
        for m in map(int, _list(rows)):
            x = jnp.asarray(rng.standard_normal((m, n_in), np.float32))
            flop = 2 * m * wn.shape[0] * wn.shape[1]
            times = [_time(_chain(p, repeat), x) / repeat for p in products]
            xn = np.asarray(x)
            times.append(_time(lambda xn=xn, wn=wn: [xn @ wn for _ in range(repeat)]) / repeat)
            print(f"{name:>8} {m:>5}" + "".join(f" | {t * 1e3:12.3f} {flop / t / 1e9:9.1f}" for t in times))


if __name__ == "__main__":
    fire.Fire(main)
