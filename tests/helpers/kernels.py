"""Weights and inputs for the CPU kernel tests, and their Q8_0 round trips by the gguf package (ggml's reference)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, quants

from jaxllama.backends.cpu import matmul
from jaxllama.core.products import PRODUCT_IN_DIMS


def q8_0(w: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 round trip of w [..., in] (in a multiple of 32), by the gguf package."""
    return quants.dequantize(
        quants.quantize(np.asarray(w, np.float32), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    )


def weights(rng, n_out, n_in):
    """Rows of very different sizes, a row of zeros, a block of zeros and an outlier."""
    w = rng.standard_normal((n_out, n_in)).astype(np.float32) * rng.uniform(0.01, 3, (n_out, 1)).astype(np.float32)
    w[0] = 0
    w[-1, :32] = 0
    w[1, 5] = 40.0
    return w


def with_q8_0_weights(params):
    """params with every product's weight replaced by its Q8_0 round trip (gguf), along its input dims."""

    def walk(node):
        if not isinstance(node, dict):
            return node
        out = {}
        for name, value in node.items():
            if name in PRODUCT_IN_DIMS and not isinstance(value, dict):
                n_in = int(np.prod(value.shape[value.ndim - PRODUCT_IN_DIMS[name] :]))
                value = jnp.asarray(q8_0(np.asarray(value).reshape(-1, n_in)).reshape(value.shape))
            out[name] = walk(value)
        return out

    return walk(params)


def padded(x: np.ndarray) -> np.ndarray:
    """x [rows, in] with zero inputs up to a whole number of Q8_0 blocks, as the kernel pads it."""
    return np.pad(x, ((0, 0), (0, -x.shape[1] % matmul.Q_BLOCK)))


def inputs(rng, rows, n_in):
    """Rows of very different sizes, with an outlier and a row of zeros."""
    x = rng.standard_normal((rows, n_in)).astype(np.float32) * rng.uniform(0.01, 10, (rows, 1)).astype(np.float32)
    x[0, 3] = 50.0
    x[-1] = 0.0
    return x
