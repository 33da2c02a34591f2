"""The decode slots' KV cache: per layer (k, v), batch = slots, laid out as the backend reads it (`Ops.cache_layout`,
`core/cache_layout.py`; every function here takes that `layout`).

`length` is a bucket (`buckets.bucket`), not the model's context: the cache grows to the next bucket when a sequence
needs it and shrinks when the long sequences are gone, so attention reads only about the part in use. It is resized
one layer at a time, each layer's old arrays freed as its new ones are made, so that growing never holds two caches:
at most the cache and one layer's new copy (`engine/memory.py` counts that moment).
Slots are split over the mesh's `data` axis and KV heads over `model` (replicated when `model` does not
divide them), by the same logical-axis rules as the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllama.core.cache_layout import POSITIONS_MAJOR, CacheLayout
from jaxllama.core.config import ModelConfig
from jaxllama.core.model import KVCache
from jaxllama.core.sharding import named_sharding

# What the cache may be stored in (`Engine(kv_cache_dtype=...)`, `--kv-cache-dtype`); by default the weights' dtype.
# In 16 bits a decode step reads half the bytes for attention, which long sequences at large batches are bound by
# (llama.cpp's default is float16).
DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def dtype(name: str | None, default):
    """The cache's dtype for the name a user gave (None or "auto": `default`, the weights'); ValueError else."""
    if name is None or name == "auto":
        return default
    if name not in DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def cache_sharding(config: ModelConfig, mesh: Mesh, layout: CacheLayout = POSITIONS_MAJOR):
    """The shardings of one layer's (keys, values)."""
    return tuple(named_sharding(mesh, config, axes) for axes in layout.axes)


def length(cache: KVCache) -> int:
    """The positions the cache holds (the values' length axis: the same in every layout)."""
    return cache[0][1].shape[2]


def abstract(config: ModelConfig, mesh: Mesh, slots: int, length: int, dtype, layout=POSITIONS_MAJOR) -> KVCache:
    """The cache's shapes, dtypes and shardings (ShapeDtypeStructs): what programs are compiled for without one."""
    shapes, shardings = layout.shapes(config, slots, length), cache_sharding(config, mesh, layout)
    layer = tuple(jax.ShapeDtypeStruct(s, dtype, sharding=d) for s, d in zip(shapes, shardings, strict=True))
    return [layer] * config.n_layers


def allocate(config: ModelConfig, mesh: Mesh, slots: int, length: int, dtype, layout=POSITIONS_MAJOR) -> KVCache:
    shapes, shardings = layout.shapes(config, slots, length), cache_sharding(config, mesh, layout)
    make = [jax.jit(lambda s=s: jnp.zeros(s, dtype), out_shardings=d) for s, d in zip(shapes, shardings, strict=True)]
    return [(make[0](), make[1]()) for _ in range(config.n_layers)]


def resize_layer(layer: tuple, *, length: int, layout: CacheLayout) -> tuple:
    """One layer's (keys, values) with `length` positions: zero-padded when growing, truncated when shrinking."""

    def one(x, axis):
        if length >= x.shape[axis]:
            return jnp.pad(x, [(0, length - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)])
        return jax.lax.slice_in_dim(x, 0, length, axis=axis)

    return tuple(one(x, axis) for x, axis in zip(layer, layout.length_axis, strict=True))


def _first(span: int, axis: int) -> tuple:
    """The index of positions [0, span) of one cache array, past its batch axis."""
    return tuple(slice(0, span) if i == axis else slice(None) for i in range(1, axis + 1))


def take_rows(cache: KVCache, rows, span: int, layout: CacheLayout) -> KVCache:
    """Rows `rows` of the cache, their first `span` positions (an index past the last row clips to it)."""
    return [
        tuple(
            jnp.take(x[(slice(None), *_first(span, axis))], rows, axis=0, mode="clip")
            for x, axis in zip(layer, layout.length_axis, strict=True)
        )
        for layer in cache
    ]


def put_rows(cache: KVCache, new: KVCache, rows, span: int, layout: CacheLayout) -> KVCache:
    """The cache with the first `span` positions of rows `rows` replaced by `new` (an index past the last row
    writes nothing)."""
    return [
        tuple(
            x.at[(rows, *_first(span, axis))].set(n.astype(x.dtype), mode="drop")
            for x, n, axis in zip(layer, new_layer, layout.length_axis, strict=True)
        )
        for layer, new_layer in zip(cache, new, strict=True)
    ]
