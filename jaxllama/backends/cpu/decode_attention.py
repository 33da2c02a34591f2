"""Decode attention as a hand-written CPU kernel (`decode_attention.cc`), called from jitted code through XLA's FFI
once `library.load` has built and registered it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

TARGET = "jaxllama_decode_attention"


def decode_attention(q, keys, values, slots, positions):
    """One query per row: q [b, kv, g, hd]; keys [n, kv, hd, s] and values [n, kv, s, hd], the whole cache; slots
    [b] int32, the cache row of each query row (>= n: a padding row, whose output is zeros); positions [b] int32,
    each query's position (it sees cache positions 0..position) -> [b, kv, g, hd]. q and the result float32; the
    cache float32, float16 or bfloat16, or uint16 holding bfloat16's bits (`int8_kv.BITS`). Over a bfloat16 cache,
    on a CPU with AVX-512 BF16, q.k and p.v are bfloat16 products (`attends_in_bfloat16`)."""
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return jax.ffi.ffi_call(TARGET, out)(q, keys, values, slots.astype(jnp.int32), positions.astype(jnp.int32))
