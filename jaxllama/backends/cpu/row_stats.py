"""Each row's argmax, max and logsumexp in one pass, by the CPU kernel `row_stats.cc`, called from jitted code
through XLA's FFI once `library.load` has built and registered it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

TARGET = "jaxllama_row_stats"


def row_stats(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [b, v] float32 -> (argmax [b] int32, the first maximum; max [b]; logsumexp [b])."""
    b = logits.shape[0]
    out = (
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.float32),
    )
    return jax.ffi.ffi_call(TARGET, out)(logits.astype(jnp.float32))
