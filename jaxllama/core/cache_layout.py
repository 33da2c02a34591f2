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

# The logical axes of keys and values, by layout (`core/sharding.py` maps them onto a mesh).
_VALUES = ("batch", "kv_heads", "cache_seq", "head_dim")
_TRANSPOSED = ("batch", "kv_heads", "head_dim", "cache_seq")


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """keys transposed ([batch, kv_heads, head_dim, positions]) or positions-major, like the values."""

    transposed_keys: bool = False

    @property
    def axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The logical axes of (keys, values)."""
        return (_TRANSPOSED if self.transposed_keys else _VALUES), _VALUES

    @property
    def length_axis(self) -> tuple[int, int]:
        """The positions' axis of (keys, values)."""
        return (3 if self.transposed_keys else 2), 2

    def shapes(self, config, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one layer's (keys, values) for `batch` rows of `length` positions."""
        kv, hd = config.n_kv_heads, config.head_dim
        values = (batch, kv, length, hd)
        return ((batch, kv, hd, length) if self.transposed_keys else values), values


POSITIONS_MAJOR = CacheLayout(transposed_keys=False)
TRANSPOSED_KEYS = CacheLayout(transposed_keys=True)
