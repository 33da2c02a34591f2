"""The decode slots' KV cache: per layer (k, v), batch = slots, laid out as the backend reads it (`Ops.cache_layout`,
`core/cache_layout.py`; every function here takes that `layout`).

`length` is a bucket (`buckets.bucket`), not the model's context: the cache grows to the next bucket when a sequence
needs it and shrinks when the long sequences are gone, so attention reads only about the part in use. It is resized
one layer at a time, each layer's old arrays freed as its new ones are made, so that growing never holds two caches:
at most the cache and one layer's new copy (`engine/memory.py` counts that moment).
Slots are split over the mesh's `data` axis and KV heads over `model` (replicated when `model` does not
divide them), by the same logical-axis rules as the weights.

An int8 cache (`core/int8_kv.py`) holds each of a layer's keys and values as an `Int8KV` (the int8 array and its
scales, whose positions' axis is the same): the functions here map over both.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllama.core import int8_kv
from jaxllama.core.cache_layout import POSITIONS_MAJOR, CacheLayout
from jaxllama.core.config import ModelConfig
from jaxllama.core.model import KVCache
from jaxllama.core.sharding import named_sharding
from jaxllama.errors import InvalidOption

_ALLOCATOR = ThreadPoolExecutor(1, thread_name_prefix="jaxllama-kv-cache")

# What the cache may be stored in (`Engine(kv_cache_dtype=...)`, `--kv-cache-dtype`); by default the weights' dtype.
# In 16 bits a decode step reads half the bytes for attention, which long sequences at large batches are bound by
# (llama.cpp's default is float16); in int8 (XLA's path: `core/int8_kv.py`) a quarter.
DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


def dtype(name: str | None, default):
    """The cache's dtype for the name a user gave (None or "auto": `default`, the weights'); InvalidOption else."""
    if name is None or name == "auto":
        return default
    if name not in DTYPES:
        raise InvalidOption("kv_cache_dtype", name, f"expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_layout(dtype, layout: CacheLayout) -> None:
    """Raise ValueError where the backend's layout cannot hold a cache of `dtype` (int8: XLA's path only)."""
    if int8_kv.is_int8(dtype) and layout.transposed_keys:
        raise ValueError(
            "kv_cache_dtype=int8: XLA's path only (a TPU or GPU, or a mesh of several CPU devices); the CPU kernels "
            "keep the cache in float32, float16 or bfloat16"
        )


def cache_sharding(config: ModelConfig, mesh: Mesh, layout: CacheLayout = POSITIONS_MAJOR, dtype=None):
    """The shardings of one layer's (keys, values): `Int8KV`s of the arrays' and their scales' for an int8 cache."""
    shardings = tuple(named_sharding(mesh, config, axes) for axes in layout.axes)
    if int8_kv.is_int8(dtype):
        scales = named_sharding(mesh, config, layout.axes[1][:-1])
        return tuple(int8_kv.Int8KV(d, scales) for d in shardings)
    return shardings


def length(cache: KVCache) -> int:
    """The positions the cache holds (the values' length axis: the same in every layout)."""
    return cache[0][1].shape[2]


def abstract(config: ModelConfig, mesh: Mesh, slots: int, length: int, dtype, layout=POSITIONS_MAJOR) -> KVCache:
    """The cache's shapes, dtypes and shardings (ShapeDtypeStructs): what programs are compiled for without one."""
    check_layout(dtype, layout)
    shapes, shardings = layout.shapes(config, slots, length), cache_sharding(config, mesh, layout, dtype)
    structs = jax.eval_shape(lambda: tuple(layout.zeros(s, dtype) for s in shapes))
    with_sharding = lambda x, d: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=d)
    return [jax.tree.map(with_sharding, structs, shardings)] * config.n_layers


def bytes_per_layer(config: ModelConfig, slots: int, length: int, dtype, layout=POSITIONS_MAJOR) -> int:
    """The bytes of one layer's keys and values (with an int8 cache's scales), unsharded."""
    shapes = layout.shapes(config, slots, length)
    structs = jax.eval_shape(lambda: [layout.zeros(s, dtype) for s in shapes])
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(structs))


def allocate(config: ModelConfig, mesh: Mesh, slots: int, length: int, dtype, layout=POSITIONS_MAJOR) -> KVCache:
    check_layout(dtype, layout)
    shapes, shardings = layout.shapes(config, slots, length), cache_sharding(config, mesh, layout, dtype)
    make = [
        jax.jit(lambda s=s: layout.zeros(s, dtype), out_shardings=d) for s, d in zip(shapes, shardings, strict=True)
    ]
    return [(make[0](), make[1]()) for _ in range(config.n_layers)]


class Allocation:
    """The slots' cache that `make` makes (`allocate`, or `abstract`'s ShapeDtypeStructs), as `result()` gives it:
    with `on_thread`, in one process, allocated on a thread from the start, so that the first touch of its pages (on
    a CPU, ~1 s a GB) overlaps the host's work up to the first prefill, which loads its programs meanwhile;
    otherwise when first asked for."""

    def __init__(self, make: Callable[[], KVCache], on_thread: bool):
        self._make = make
        self._future = _ALLOCATOR.submit(make) if on_thread and jax.process_count() == 1 else None

    def result(self) -> KVCache:
        return self._future.result() if self._future is not None else self._make()


def resize_layer(layer: tuple, *, length: int, layout: CacheLayout) -> tuple:
    """One layer's (keys, values) with `length` positions: zero-padded when growing, truncated when shrinking."""

    def one(x, axis):
        if length >= x.shape[axis]:
            return jnp.pad(x, [(0, length - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)])
        return jax.lax.slice_in_dim(x, 0, length, axis=axis)

    axes = layout.length_axis
    return tuple(jax.tree.map(lambda x, a=axis: one(x, a), c) for c, axis in zip(layer, axes, strict=True))


def _first(span: int, axis: int) -> tuple:
    """The index of positions [0, span) of one cache array, past its batch axis."""
    return tuple(slice(0, span) if i == axis else slice(None) for i in range(1, axis + 1))


def take_rows(cache: KVCache, rows, span: int, layout: CacheLayout) -> KVCache:
    """Rows `rows` of the cache, their first `span` positions (an index past the last row clips to it)."""
    take = lambda x, axis: jnp.take(x[(slice(None), *_first(span, axis))], rows, axis=0, mode="clip")
    return [
        tuple(jax.tree.map(lambda x, a=axis: take(x, a), c) for c, axis in zip(layer, layout.length_axis, strict=True))
        for layer in cache
    ]


def put_rows(cache: KVCache, new: KVCache, rows, span: int, layout: CacheLayout) -> KVCache:
    """The cache with the first `span` positions of rows `rows` replaced by `new` (an index past the last row
    writes nothing)."""
    put = lambda x, n, axis: x.at[(rows, *_first(span, axis))].set(n.astype(x.dtype), mode="drop")
    return [
        tuple(
            jax.tree.map(lambda x, n, a=axis: put(x, n, a), c, m)
            for c, m, axis in zip(layer, new_layer, layout.length_axis, strict=True)
        )
        for layer, new_layer in zip(cache, new, strict=True)
    ]


# Positions `copy_rows` moves at a time: each pair copies its length rounded up to this, not the cache's whole
# length, in a loop whose count is data (so one program serves every length).
COPY_CHUNK = 256


def copy_rows(cache: KVCache, sources, rows, lengths, layout: CacheLayout) -> KVCache:
    """The cache with the first `lengths[i]` positions (rounded up to COPY_CHUNK, or the whole cache where shorter)
    of row `rows[i]` copied from row `sources[i]`: reused prefixes, before a packed prefill computes the rest of the
    prompts in place. The pairs run one after another, in place, holding no more than one chunk of one row aside (a
    gather of every pair's rows would hold as many bytes as it copies), so a row copied into must not be one a later
    pair copies from; the pairs end at the first whose row is out of range."""
    positions = length(cache)
    step = min(COPY_CHUNK, positions)
    n = jnp.argmin(jnp.append(rows < cache[0][1].shape[0], False))  # the pairs before the first out of range

    def chunk(x, axis: int, source, row, at):
        size = tuple(1 if i == 0 else step if i == axis else d for i, d in enumerate(x.shape))
        start = tuple(source if i == 0 else at if i == axis else 0 for i in range(x.ndim))
        piece = jax.lax.dynamic_slice(x, start, size)
        return jax.lax.dynamic_update_slice(x, piece, (row,) + start[1:])

    def pair(i, cache):
        def piece(c, cache):
            at = jnp.minimum(c * step, positions - step)
            return [
                tuple(
                    jax.tree.map(lambda x, a=axis: chunk(x, a, sources[i], rows[i], at), kv)
                    for kv, axis in zip(layer, layout.length_axis, strict=True)
                )
                for layer in cache
            ]

        return jax.lax.fori_loop(0, (lengths[i] + step - 1) // step, piece, cache)

    return jax.lax.fori_loop(0, n, pair, cache)
