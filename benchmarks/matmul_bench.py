"""The CPU matmul kernel alone at a model's product shapes, for each form a weight is read in: float32 and
bfloat16 panels, and each quantized format (`matmul.QUANTIZATIONS`: q8_0, w8a8, q4_0), against numpy's (OpenBLAS)
float32 product of the same shape. Per call, timed in a jitted chain of `repeat` calls: ms, G(FL)OP/s, the share of
the peak of the arithmetic that form runs on (`benchmarks.peaks`, measured first in the same run: float32 FMAs for
float32 and bfloat16, int16 pairs for q8_0, int8 quads for w8a8 and q4_0), GB/s of weights read (each form's own
bytes), and each form's speed as a ratio to float32's.

    python -m benchmarks.matmul_bench [--model smollm2|llama-3.2-1b] [--rows 1,32] [--repeat 20] [--shapes qkv,o]
                                      [--forms q8_0,w8a8]
"""

from __future__ import annotations

import time

import fire
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import peaks
from jaxllama.backends.cpu import library, matmul
from jaxllama.engine.runtime import cache_dir

# Each model's products as (in, out): q/k/v as one product, o, gate/up as one gated product (out: its hidden
# size), down, the output layer (the vocabulary of the random-weight checkpoints of real shapes: 49,152).
MODELS = {
    "smollm2": {
        "qkv": (576, 960),
        "o": (576, 576),
        "gate_up": (576, 1536),
        "down": (1536, 576),
        "output": (576, 49152),
    },
    "llama-3.2-1b": {
        "qkv": (2048, 3072),
        "o": (2048, 2048),
        "gate_up": (2048, 8192),
        "down": (8192, 2048),
        "output": (2048, 49152),
    },
}
FORMS = ("float32", "bfloat16", *matmul.QUANTIZATIONS)
# The arithmetic each form's products run on (`benchmarks.peaks.FORMS`), whose peak their G(FL)OP/s are a share of.
PEAK_OF = {
    "float32": "float32_fma",
    "bfloat16": "float32_fma",
    "q8_0": "int16_pairs",
    "w8a8": "int8_quads",
    "q4_0": "int8_quads",
    "numpy float32": "float32_fma",
}


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


def _forms(w: jax.Array, gated: bool) -> dict[str, matmul.Packed]:
    """The weight w [out, in] (gated: gate rows then up rows) packed in each of FORMS."""
    half = w.shape[0] // 2
    pack = (lambda v: matmul.pack_gated(v[:half], v[half:])) if gated else matmul.pack
    float32, bfloat16 = pack(w), pack(w.astype(jnp.bfloat16))
    return {"float32": float32, "bfloat16": bfloat16, **{q: matmul.quantize(float32, q) for q in matmul.QUANTIZATIONS}}


def _bytes(w: matmul.Packed) -> int:
    return w.panels.nbytes + (0 if w.scales is None else w.scales.nbytes)


def main(model: str = "smollm2", rows: str = "1,32", repeat: int = 20, shapes: str = "", forms: str = ""):
    if not library.load(cache_dir() / "kernels"):
        raise SystemExit("the CPU kernels could not be built")
    peak = peaks.measure()
    print("peaks, from registers on every core: " + ", ".join(f"{k} {v:.0f} G(FL)OP/s" for k, v in peak.items()))
    rng = np.random.default_rng(0)
    sizes = MODELS[model]
    wanted = _list(forms) if forms else FORMS
    print(f"{model}; per form: ms per call, G(FL)OP/s, % of its form's peak, GB/s of weights read, speed / float32's")
    names = (*wanted, "numpy float32") if "float32" in wanted else (*wanted, "float32", "numpy float32")
    print(f"{'shape':>8} {'rows':>5}" + "".join(f" | {name:>32}" for name in names))
    for name in _list(shapes) if shapes else sizes:
        n_in, n_out = sizes[name]
        gated = name == "gate_up"
        w = jnp.asarray(rng.standard_normal((2 * n_out if gated else n_out, n_in), np.float32) * 0.02)
        packed = _forms(w, gated)
        products = {f: packed[f] for f in names if f in packed}
        wn = np.asarray(w).T.copy()
        for m in map(int, _list(rows)):
            x = jnp.asarray(rng.standard_normal((m, n_in), np.float32))
            flop = 2 * m * wn.shape[0] * wn.shape[1]
            times = {f: _time(_chain(p, repeat), x) / repeat for f, p in products.items()}
            xn = np.asarray(x)
            times["numpy float32"] = _time(lambda xn=xn, wn=wn: [xn @ wn for _ in range(repeat)]) / repeat
            cells = []
            for f, t in times.items():
                read = _bytes(products[f]) if f in products else wn.nbytes
                rate, speedup = flop / t / 1e9, times["float32"] / t
                share = 100 * rate / peak[PEAK_OF[f]]
                cells.append(f"{t * 1e3:7.3f} {rate:6.1f} {share:3.0f}% {read / t / 1e9:5.1f} {speedup:4.2f}x")
            print(f"{name:>8} {m:>5}" + "".join(f" | {c:>32}" for c in cells), flush=True)


if __name__ == "__main__":
    fire.Fire(main)
