"""A KV cache kept in int8 (`--kv-cache-dtype int8`), as jax-llm-examples keeps its Llama cache on TPU: each cached
key or value vector (one row, KV head and position: head_dim numbers) is stored as int8 with one float32 scale,
max |x| / 127, rounded to nearest. A decode step reads a byte a number instead of bfloat16's two (plus 4 bytes of
scale per vector), which a long-context decode step, bound by the cache it reads, turns into time.

Attention never dequantizes the cache into memory: q.k runs on the int8 keys widened in the product's operands, and
each position's score is then multiplied by its key's scale; each probability is multiplied by its value's scale
before the product with the int8 values. Scales are [rows, kv_heads, positions] (positions minor, as a TPU tiles an
array's last axis by 128: a trailing axis of 1 would take 128 times its bytes).

XLA's path only (positions-major keys, `cache_layout.POSITIONS_MAJOR`); the CPU kernels read float caches.

A float cache's arrays are written here too (`write`), and one layout keeps a bfloat16 cache as its bits (BITS,
`CacheLayout.bfloat16_bits`): XLA:CPU writes into a bfloat16 array by converting all of it to float32 and back (a
decode step then copies the whole cache: 5x slower decode on the default model), while it scatters 16-bit integers
in place. The CPU kernels read the bits as bfloat16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

INT8 = jnp.dtype(jnp.int8)
SCALE = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8KV:
    """One layer's keys or values in int8: `values` [rows, kv_heads, positions, head_dim] int8, `scales` [rows,
    kv_heads, positions] float32. `shape` and `dtype` are the cached array's, as a float cache's."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return INT8


def is_int8(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype) == INT8


def scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape of a cache array of `shape` (its head_dim axis dropped)."""
    return tuple(shape[:-1])


BITS = jnp.uint16


def as_stored(new: jax.Array, dtype) -> jax.Array:
    """Keys or values to write into a float cache array of `dtype`: rounded to it, or to bfloat16 and given as its
    bits (BITS)."""
    if jnp.dtype(dtype) == BITS:
        return jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), BITS)
    return new.astype(dtype)


def zeros(shape: tuple[int, ...], dtype) -> jax.Array | Int8KV:
    """A zero cache array of `shape` in `dtype` (an `Int8KV` for int8)."""
    if is_int8(dtype):
        return Int8KV(jnp.zeros(shape, INT8), jnp.zeros(scales_shape(shape), SCALE))
    return jnp.zeros(shape, dtype)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (int8 [..., head_dim], scales [...]): each vector over its largest magnitude / 127."""
    x = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scales > 0, scales, 1.0)
    values = jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(INT8)
    return values, scales.astype(SCALE)


def as_read(new: jax.Array, cache) -> jax.Array | None:
    """Keys or values [..., head_dim] as attention reads them back once written to `cache` (an array or `Int8KV`),
    in new's dtype: an int8 cache's rounded to their vector's 255 steps, a float cache's as they are where it stores
    new's dtype; None where it stores another (a prompt's own attention then reads the cache)."""
    if isinstance(cache, Int8KV):
        values, scales = quantize(new)
        return (values.astype(jnp.float32) * scales[..., None]).astype(new.dtype)
    return new if cache.dtype == new.dtype else None


def write(cache, index: tuple, new: jax.Array):
    """`cache` (an array or `Int8KV`) with `new` [..., head_dim] stored at `index` (advanced indices whose result
    has new's shape; out-of-range rows dropped)."""
    if isinstance(cache, Int8KV):
        values, scales = quantize(new)
        return Int8KV(cache.values.at[index].set(values, mode="drop"), cache.scales.at[index].set(scales, mode="drop"))
    return cache.at[index].set(as_stored(new, cache.dtype), mode="drop")


def split(cache) -> tuple[jax.Array, jax.Array | None]:
    """(the stored array, its scales [rows, kv_heads, positions] or None for a float cache)."""
    if isinstance(cache, Int8KV):
        return cache.values, cache.scales
    return cache, None
