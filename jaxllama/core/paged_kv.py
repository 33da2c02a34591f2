"""A paged KV cache: each layer's keys and values live in one pool of fixed-size pages, [kv_heads, pages, page_size,
head_dim] (int8: an `Int8KV` whose scales are [kv_heads, pages, page_size]), and each sequence in the pages its row
of a page table names: position p of row i sits at offset p % page_size of page table[i, p // page_size].

This is the layout of the paged attention kernels made for accelerators (jax's Pallas TPU `paged_attention`, as
JetStream and vLLM page their caches): positions-major within a page, so a step writes one head_dim vector per head
in place and attention reads whole pages. Sequences that share a prefix share its pages (the page table points
twice at one page) instead of copying it, and the pool never grows or copies: the engine gives out pages as
sequences need them (`engine/pages.py`).

An entry of a table past the pool's last page is a page not given out: writes to it are dropped, reads of it clip
to the last page and are masked out by position, as every position past a row's own is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllama.core import int8_kv

# The logical axes of a pool of keys or values (`core/sharding.py`): KV heads split over `model`, as a contiguous
# cache's are.
AXES = ("kv_heads", "cache_pages", "cache_seq", "head_dim")


def shape(config, pages: int, page_size: int) -> tuple[int, int, int, int]:
    """The shape of one layer's pool of keys (or values)."""
    return config.n_kv_heads, pages, page_size, config.head_dim


def write(pool, table: jax.Array, positions: jax.Array, new: jax.Array):
    """`pool` (an array or `Int8KV`) with new [b, t, kv, hd] stored at positions [b, t] of the rows whose pages
    table [b, n] names (positions past a row's table, and pages past the pool, are dropped). A call of several tokens
    a row (a prompt) starts each row at a page boundary (the engine's do: a prefix is reused in whole pages) and is
    written a page at a time, past its last token too, into the row's own pages: a position past a row's length is
    written again before it is read."""
    page_size = pool.shape[2]
    if new.shape[1] == 1:
        return int8_kv.write(
            pool,
            (slice(None), _pages(table, positions // page_size, pool), positions % page_size),
            jnp.moveaxis(new, 2, 0),
        )
    # Whole pages: a scatter along the pool's pages alone, which a TPU runs in place (a scatter of single positions
    # into [pages, page_size] makes it copy each layer's pool to another layout and back).
    b, t = new.shape[:2]
    n = -(-t // page_size)
    new = jnp.pad(new, ((0, 0), (0, n * page_size - t), (0, 0), (0, 0))).reshape(b, n, page_size, *new.shape[2:])
    index = positions[:, :1] // page_size + jnp.arange(n)[None]
    return int8_kv.write(pool, (slice(None), _pages(table, index, pool)), jnp.moveaxis(new, 3, 0))


def _pages(table: jax.Array, index: jax.Array, pool) -> jax.Array:
    """The pages of rows' page-table entries `index` [b, ...]; the pool's size (nowhere) past a row's table."""
    pages = jnp.take_along_axis(table, jnp.minimum(index, table.shape[1] - 1), axis=1)
    return jnp.where(index < table.shape[1], pages, pool.shape[1])


def gather(pool, table: jax.Array):
    """The rows' sequences, read through their pages: pool [kv, pages, P, hd] and table [b, n] -> [b, kv, n * P, hd]
    (an `Int8KV` of values and scales [b, kv, n * P] for an int8 pool), as a contiguous cache's rows."""

    def rows(x):
        x = jnp.take(x, table, axis=1, mode="clip")  # [kv, b, n, P, ...]
        x = jnp.moveaxis(x, 1, 0)
        return x.reshape(*x.shape[:2], x.shape[2] * x.shape[3], *x.shape[4:])

    return jax.tree.map(rows, pool)
