"""The decode slots' KV cache: per layer (k, v) of [slots, kv_heads, length, head_dim].

`length` is a bucket, not the model's context: the cache grows to the next bucket when a sequence
needs it and shrinks when the long sequences are gone, so attention reads only about the part in use.
Slots are split over the mesh's `data` axis and KV heads over `model` (replicated when `model` does not
divide them), by the same logical-axis rules as the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import KVCache
from jaxllama.core.sharding import named_sharding

CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")
MIN_BUCKET = 64


def cache_sharding(config: ModelConfig, mesh: Mesh):
    return named_sharding(mesh, config, CACHE_AXES)


def bucket(n: int, limit: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= n (at least `minimum`), capped at `limit`."""
    size = minimum
    while size < n:
        size *= 2
    return min(size, limit)


def prompt_bucket(n: int, limit: int) -> int:
    """Padded prompt length: a multiple of 16 up to 64, then 1x or 1.5x a power of two (64, 96, 128, 192, ...),
    so that padding wastes at most a third of a prefill while compilations stay few."""
    if n <= 64:
        size = max(16, -(-n // 16) * 16)
    else:
        size = 64
        while size < n:
            size = size * 3 // 2 if (size & (size - 1)) == 0 else size * 4 // 3
    return min(size, limit)


def allocate(config: ModelConfig, mesh: Mesh, slots: int, length: int, dtype) -> KVCache:
    sharding = cache_sharding(config, mesh)
    shape = (slots, config.n_kv_heads, length, config.head_dim)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(make(), make()) for _ in range(config.n_layers)]


def resize(cache: KVCache, length: int) -> KVCache:
    """The same cache with `length` positions: zero-padded when growing, truncated when shrinking."""
    current = cache[0][0].shape[2]
    if length >= current:
        pad = ((0, 0), (0, 0), (0, length - current), (0, 0))
        return jax.tree.map(lambda x: jnp.pad(x, pad), cache)
    return jax.tree.map(lambda x: x[:, :, :length], cache)
