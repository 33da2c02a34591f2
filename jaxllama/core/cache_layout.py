"""How one layer's KV cache is laid out: a fact of the backend that reads it (`Ops.cache_layout`), which every
function that makes, writes, reads or resizes the cache asks.

Values are always [batch, kv_heads, positions, head_dim]. Keys are either the same (positions-major: a decode step
writes one contiguous head_dim vector per head, and q.k runs as a batched matrix product, on a TPU's or GPU's matrix
unit) or transposed, [batch, kv_heads, head_dim, positions] (the CPU kernels: their q.k loops read the cached
positions in order). Compiled for a TPU, the transposed keys cost a copy of each layer's key cache to another layout
and back every decode step (benchmarks/README.md, `jaxllama compile`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxllama.core import int8_kv, paged_kv

# The logical axes of keys and values, by layout (`core/sharding.py` maps them onto a mesh).
_VALUES = ("batch", "kv_heads", "cache_seq", "head_dim")
_TRANSPOSED = ("batch", "kv_heads", "head_dim", "cache_seq")


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """keys transposed ([batch, kv_heads, head_dim, positions]) or positions-major, like the values; or, with a
    `page_size`, both in a pool of pages (`core/paged_kv.py`), a slot's worth of pages for every slot."""

    transposed_keys: bool = False
    page_size: int = 0
    bfloat16_bits: bool = False  # a bfloat16 cache kept as its bits (`int8_kv.BITS`)

    def zeros(self, shape: tuple[int, ...], dtype):
        """A zero cache array of `shape` for a cache of `dtype`, as this layout stores it: a bfloat16 cache as its
        bits where `bfloat16_bits`, an int8 cache as an `int8_kv.Int8KV`."""
        bits = self.bfloat16_bits and jnp.dtype(dtype) == jnp.bfloat16
        return int8_kv.zeros(shape, int8_kv.BITS if bits else dtype)

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The logical axes of (keys, values)."""
        if self.paged:
            return paged_kv.AXES, paged_kv.AXES
        return (_TRANSPOSED if self.transposed_keys else _VALUES), _VALUES

    @property
    def length_axis(self) -> tuple[int, int]:
        """The positions' axis of (keys, values)."""
        return (3 if self.transposed_keys else 2), 2

    def shapes(self, config, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one layer's (keys, values) for `batch` rows of `length` positions (paged: the pool's)."""
        if self.paged:
            pool = paged_kv.shape(config, batch * -(-length // self.page_size), self.page_size)
            return pool, pool
        kv, hd = config.n_kv_heads, config.head_dim
        values = (batch, kv, length, hd)
        return ((batch, kv, hd, length) if self.transposed_keys else values), values


POSITIONS_MAJOR = CacheLayout(transposed_keys=False)
TRANSPOSED_KEYS = CacheLayout(transposed_keys=True, bfloat16_bits=True)
