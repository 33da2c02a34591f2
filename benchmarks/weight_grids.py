"""What int8 grids of other shapes would do to the default model's next-token distributions, before any kernel
reads them. Every weight that may be stored as blocks (each product's and the embedding, which SmolLM2's output
layer shares) is quantized and dequantized here, then the model runs in float32 on XLA's path, against the GGUF's own
weights in float32 (`weight_quality`'s reference and measure). The inputs stay float32: this measures the weights'
grid alone.

    python -m benchmarks.weight_grids [JOB.jsonl] [--model GGUF] [--grids 32,128,q8_0:128,int8] [--lines 24]

A grid is:
- G: groups of G inputs of each output, from the float32 weights: scale = the group's largest |w| / 127, q rounded
  to nearest, half away from zero (32: Q8_0 with a float32 scale);
- "q8_0": Q8_0 blocks as llama.cpp makes them (`tests`' oracle, the gguf package), what the default weights hold;
- "q8_0:G": those Q8_0 blocks, then regrouped by G as above (a load-time regrouping of a Q8_0 checkpoint);
- "int8": a scale per output channel over those Q8_0 blocks, as `--quantize int8` loads a Q8_0 checkpoint
  (`core.int8_weights`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import fire
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, quants

from benchmarks.divergence import HEADER, answered_texts, row
from benchmarks.weight_quality import REPO, _log_softmax
from converters.llama import convert
from jaxllama import LLM
from jaxllama.core import int8_weights
from jaxllama.core.params import block_in_dims
from jaxllama.default_model import default_gguf


def grouped(w: np.ndarray, group: int) -> np.ndarray:
    """w [out, in] on an int8 grid per `group` inputs of each output (a row's last group what remains), dequantized."""
    n, k = w.shape
    g = np.pad(w.astype(np.float64), ((0, 0), (0, -k % group))).reshape(n, -1, group)
    scale = np.abs(g).max(axis=-1, keepdims=True) / 127
    q = np.sign(g) * np.floor(np.abs(g / np.where(scale > 0, scale, 1)) + 0.5)
    return (q * scale).reshape(n, -1)[:, :k].astype(np.float32)


def q8_0(w: np.ndarray) -> np.ndarray:
    t = GGMLQuantizationType.Q8_0
    return quants.dequantize(quants.quantize(np.ascontiguousarray(w, np.float32), t), t)


def on_grid(w: np.ndarray, grid: str) -> np.ndarray:
    """w [out, in] float32 -> its dequantized values on `grid` (the module's list)."""
    if grid == "q8_0":
        return q8_0(w)
    if grid == "int8":
        return np.asarray(int8_weights.dequantize(int8_weights.quantize(jnp.asarray(q8_0(w)))))
    source, _, size = grid.rpartition(":")
    return grouped(q8_0(w) if source == "q8_0" else w, int(size))


def with_grid(params, grid: str):
    """params with every weight that may be stored as blocks put on `grid` along its input dims."""

    def walk(node, name: str):
        if isinstance(node, dict):
            return {k: walk(v, f"{name}/{k}" if name else k) for k, v in node.items()}
        in_dims = block_in_dims(name)
        if in_dims is None:
            return node
        w = np.asarray(node, np.float32)
        n_in = int(np.prod(w.shape[w.ndim - in_dims :]))
        return jnp.asarray(on_grid(w.reshape(-1, n_in), grid).reshape(w.shape))

    return walk(params, "")


def main(
    job: str = str(REPO / "jobs" / "eval.jsonl"),
    model: str | None = None,
    grids: str = "q8_0,32,64,128,q8_0:64,q8_0:128,int8",
    lines: int = 24,
    max_tokens: int = 64,
) -> None:
    gguf = Path(model) if model else default_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = convert(gguf, Path(tmp) / "f32", dtype="float32", progress=False)
        exact = LLM.load(checkpoint, max_slots=8, cpu_kernels=False)
        texts = answered_texts(exact, job, lines, max_tokens)
        reference = [_log_softmax(x[: len(t)]) for x, t in zip(exact.logits(texts), texts, strict=True)]
        print(f"{len(texts)} texts, {sum(map(len, texts))} positions, {gguf.name}")
        print(f"{'grid':<10} {HEADER}")
        weights = jax.tree.map(np.asarray, exact.params)
        for grid in grids.split(","):
            llm = LLM(
                exact.config,
                with_grid(weights, grid),
                exact.mesh,
                exact.tokenizer,
                exact.template,
                exact.eos_ids,
                ops=exact.engine.ops,
            )
            got = [_log_softmax(x[: len(t)]) for x, t in zip(llm.logits(texts), texts, strict=True)]
            print(f"{grid:<10} {row(reference, got)}", flush=True)
            del llm


if __name__ == "__main__":
    fire.Fire(main)
