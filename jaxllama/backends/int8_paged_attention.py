"""A decode step's attention over an int8 paged cache on a TPU, as a Pallas kernel: each row reads its own pages up to
its length, a block of pages at a time, and each page's int8 keys and values with their scales (one float32 a
position and head, `core/int8_kv.py`), a byte a number where a bfloat16 cache takes two.

jax's own TPU kernel (`pallas.ops.tpu.paged_attention`) takes int8 pages only with scales as wide as the head
([..., page_size, head_dim]): it would read four times the values' bytes in scales. Here the scales are read as they
are stored ([kv_heads, pages, page_size]) and applied where they cost least: a key's scale multiplies its score
(q.k over int8 keys, widened), a value's multiplies its probability before the product with the int8 values.

The loop is jax's kernel's: a grid over rows and KV heads run in order, each one's blocks of pages double-buffered,
and the next row's (or head's) first block fetched while the last of this one is computed, so the DMA engine never
waits for a new row. Each page of a block is attended as its own tile of scores ([groups, page_size]): the scales of
a page are a row of VMEM and multiply the scores' lanes as they are, where joining a block's pages into one row of
lanes would cost a relayout.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxllama.core.int8_kv import Int8KV

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a score past a row's length: exp() of it minus a max is 0


def paged_attention(q, pool_k: Int8KV, pool_v: Int8KV, lengths, pages, *, pages_per_block: int):
    """q [b, heads, hd] (scaled), int8 pools (values [kv_heads, P, page_size, hd], scales [kv_heads, P, page_size]),
    lengths [b] int32 (>= 1), pages [b, n] int32 (entries < P) -> [b, heads, hd] float32."""
    b, heads, hd = q.shape
    kv_heads, _, page_size, _ = pool_k.values.shape
    groups = heads // kv_heads
    n = pages.shape[1]
    if n % pages_per_block:
        raise ValueError(f"a row's {n} pages are not whole blocks of {pages_per_block}")
    # a [groups, hd] block of fewer than 8 rows is laid out as 8; [groups, 1, hd] takes the [1, 128] layout it has
    q = q.astype(jnp.float32).reshape(b, heads, 1, hd)
    rows = pl.BlockSpec((None, groups, None, hd), lambda row, head, *_: (row, head, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # two of each: a block computed while the next is fetched
    values = pltpu.VMEM((2, pages_per_block, page_size, hd), jnp.int8)
    scales = pltpu.VMEM((2, pages_per_block, page_size), jnp.float32)
    scratch = [values, scales, values, scales, pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))]
    kernel = functools.partial(_attend, pages_per_block=pages_per_block, pages_per_row=n)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # lengths, pages
            grid=(b, kv_heads),
            in_specs=[rows, hbm, hbm, hbm, hbm],
            out_specs=rows,
            scratch_shapes=[*scratch, pltpu.SMEM((1,), jnp.int32)],  # and which of the two holds this block
        ),
        # in order: a step fetches the next step's first block
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
    )(lengths, pages.reshape(-1), q, pool_k.values, pool_k.scales, pool_v.values, pool_v.scales)
    return out.reshape(b, heads, hd)


class _Cache(NamedTuple):
    """One side of the cache (keys or values) as a kernel step sees it: the int8 pool and its scales in HBM, their
    double buffers in VMEM ([2, pages_per_block, ...]: a block computed while the next is fetched), and the DMA
    semaphores of the two buffers."""

    pool: object
    scales: object
    pool_buf: object
    scales_buf: object
    sems: object

    def copies(self, head, pages, slot) -> list:
        """The DMAs of `pages` (one block of a row's) and their scales into buffer `slot`."""
        return [
            pltpu.make_async_copy(src.at[head, page], dst.at[slot, j], self.sems.at[slot])
            for j, page in enumerate(pages)
            for src, dst in ((self.pool, self.pool_buf), (self.scales, self.scales_buf))
        ]

    def page(self, slot, j):
        """Page j of buffer `slot`, widened ([page_size, hd] float32), and its scales as a row ([1, page_size])."""
        return self.pool_buf[slot, j].astype(jnp.float32), self.scales_buf[slot, pl.ds(j, 1), :]


def _attend(lengths_ref, pages_ref, q_ref, *refs, pages_per_block, pages_per_row):
    """One row's attention with one KV head's query group (q_ref, o_ref [groups, hd]), over its blocks of pages.
    `refs`: the pools and their scales in HBM (keys', values'), the output, then the scratch: the double buffers
    (keys', values'), their DMA semaphores, and which of the two buffers holds this block (`slot_ref`)."""
    k_hbm, ks_hbm, v_hbm, vs_hbm, o_ref, k_buf, ks_buf, v_buf, vs_buf, k_sems, v_sems, slot_ref = refs
    keys, values = _Cache(k_hbm, ks_hbm, k_buf, ks_buf, k_sems), _Cache(v_hbm, vs_hbm, v_buf, vs_buf, v_sems)
    row, head = pl.program_id(0), pl.program_id(1)
    last_row, last_head = pl.num_programs(0) - 1, pl.num_programs(1) - 1
    page_size = k_hbm.shape[2]
    span = page_size * pages_per_block
    length = lengths_ref[row]

    def copies(row, head, block, slot):
        """The DMAs of one block of a row's pages: keys' and values'."""
        first = row * pages_per_row + block * pages_per_block
        pages = [pages_ref[first + j] for j in range(pages_per_block)]
        return keys.copies(head, pages, slot) + values.copies(head, pages, slot)

    def start(row, head, block, slot):
        for copy in copies(row, head, block, slot):
            copy.start()

    @pl.when((row == 0) & (head == 0))
    def _first_block_of_the_call():
        slot_ref[0] = 0
        start(row, head, 0, 0)

    blocks = jax.lax.div(length + span - 1, span)  # a truncating division: `//` lowers through sign()
    q = q_ref[...].astype(jnp.float32)
    groups, hd = q.shape

    def block(i, carry):
        slot = slot_ref[0]
        other = 1 - slot

        @pl.when(i + 1 < blocks)
        def _next_block():
            start(row, head, i + 1, other)

        @pl.when((i + 1 == blocks) & ((row < last_row) | (head < last_head)))
        def _next_rows_first_block():
            next_head = jnp.where(head < last_head, head + 1, 0)
            start(jnp.where(head < last_head, row, row + 1), next_head, 0, other)

        for copy in copies(row, head, i, slot):
            copy.wait()
        for j in range(pages_per_block):
            page = keys.page(slot, j), values.page(slot, j)
            carry = _page(q, page, i * span + j * page_size, length, carry)
        slot_ref[0] = other
        return carry

    column = jnp.zeros((groups, 1), jnp.float32)
    init = (column - jnp.inf, column, jnp.zeros((groups, hd), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, blocks, block, init)
    o_ref[...] = (acc / total).astype(o_ref.dtype)


def _page(q, page, start, length, carry):
    """The running softmax (max, total, weighted values) carried over one page of positions from `start`: `page`,
    its keys and values ([page_size, hd] float32) each with their scales ([1, page_size])."""
    (keys, key_scales), (values, value_scales) = page
    peak, total, acc = carry
    scores = jnp.einsum("gd,td->gt", q, keys, preferred_element_type=jnp.float32) * key_scales
    positions = start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(positions < length, scores, MASKED)
    new_peak = jnp.maximum(peak, scores.max(axis=-1, keepdims=True))
    p = jnp.exp(scores - new_peak)
    kept = jnp.exp(peak - new_peak)
    total = kept * total + p.sum(axis=-1, keepdims=True)
    weighted = p * value_scales
    acc = kept * acc + jnp.einsum("gt,td->gd", weighted, values, preferred_element_type=jnp.float32)
    return new_peak, total, acc
