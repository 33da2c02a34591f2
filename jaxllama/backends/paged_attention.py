"""A decode step's attention over a paged KV cache on a TPU, as a Pallas kernel: each row reads its own pages up to its
length and no further, a block of pages at a time; a bfloat16 cache's pages as they are, an int8 cache's with their
scales (one float32 a position and head, `core/int8_kv.py`), a byte a number where bfloat16 takes two.

jax's own TPU kernel (`pallas.ops.tpu.paged_attention`) copies every page of a row's last block, past the row's length
too: with blocks of 8 pages of 64 positions, its length rounded up to 512 (a row of 1,025 positions reads 1,536), and
with 8 pages of 128, to 1,024 (rows of 1,025 to 2,048 positions all read 2,048: a third more than they hold, on
average), where decode steps spend most of their time reading the cache. Here a page is copied only where the row holds
a position in it. jax's kernel also takes int8 pages only with scales as wide as the head ([..., page_size, head_dim]):
it would read four times the values' bytes in scales; here the scales are read as they are stored ([kv_heads, pages,
page_size]) and applied where they cost least: a key's scale multiplies its score (q.k over int8 keys, widened), a
value's multiplies its probability before the product with the int8 values.

The loop is jax's kernel's: a grid over rows and KV heads run in order, each one's blocks of pages double-buffered,
and the next row's (or head's) first block fetched while the last of this one is computed, so the DMA engine never
waits for a new row. A bfloat16 block is attended as one tile of scores ([groups, block positions]); an int8 block a
page at a time ([groups, page_size]): the scales of a page are a row of VMEM and multiply the scores' lanes as they
are, where joining a block's pages into one row of lanes would cost a relayout. A page the row does not reach is
left as the buffer held it (another page's numbers, or the zeros the call starts its buffers with) and masked.
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


def paged_attention(q, pool_k, pool_v, lengths, pages, *, pages_per_block: int, scale: float = 1.0):
    """q [b, heads, hd] (its scores multiplied by `scale`, in float32); pool_k and pool_v [kv_heads, P, page_size,
    hd] in a float dtype, or `Int8KV`s (values as those, scales [kv_heads, P, page_size]); lengths [b] int32 (>= 1),
    pages [b, n] int32 (entries < P) -> [b, heads, hd] in q's dtype."""
    b, heads, hd = q.shape
    scaled = isinstance(pool_k, Int8KV)
    pools = [pool_k.values, pool_k.scales, pool_v.values, pool_v.scales] if scaled else [pool_k, pool_v]
    kv_heads, _, page_size, _ = pools[0].shape
    groups = heads // kv_heads
    n = pages.shape[1]
    if n % pages_per_block:
        raise ValueError(f"a row's {n} pages are not whole blocks of {pages_per_block}")
    # a [groups, hd] block of fewer than 8 rows is laid out as 8; [groups, 1, hd] takes the [1, 128] layout it has
    dtype, q = q.dtype, q.astype(jnp.float32).reshape(b, heads, 1, hd)
    rows = pl.BlockSpec((None, groups, None, hd), lambda row, head, *_: (row, head, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # two of each: a block computed while the next is fetched
    side = [pltpu.VMEM((2, pages_per_block, page_size, hd), pools[0].dtype)]
    if scaled:
        side.append(pltpu.VMEM((2, pages_per_block, page_size), pools[1].dtype))
    scratch = [*side, *side, pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))]
    kernel = functools.partial(_attend, pages_per_block=pages_per_block, pages_per_row=n, scaled=scaled, scale=scale)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # lengths, pages
            grid=(b, kv_heads),
            in_specs=[rows] + [hbm] * len(pools),
            out_specs=rows,
            scratch_shapes=[*scratch, pltpu.SMEM((1,), jnp.int32)],  # and which of the two holds this block
        ),
        # in order: a step fetches the next step's first block
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        # in q's dtype: rounded by the kernel as it stores, where a float32 output is converted by an op of its own
        out_shape=jax.ShapeDtypeStruct(q.shape, dtype),
    )(lengths, pages.reshape(-1), q, *pools)
    return out.reshape(b, heads, hd)


class _Cache(NamedTuple):
    """One side of the cache (keys or values) as a kernel step sees it: the pool (and an int8 pool's scales) in HBM,
    their double buffers in VMEM ([2, pages_per_block, ...]: a block computed while the next is fetched), and the DMA
    semaphores of the two buffers. `scales` and `scales_buf` are None for a float pool."""

    pool: object
    scales: object
    pool_buf: object
    scales_buf: object
    sems: object

    def copies(self, head, page, j, slot) -> list:
        """The DMAs of page index `page` (and of its scales) into place j of buffer `slot`."""
        sides = [(self.pool, self.pool_buf)] + ([(self.scales, self.scales_buf)] if self.scales is not None else [])
        return [pltpu.make_async_copy(src.at[head, page], dst.at[slot, j], self.sems.at[slot]) for src, dst in sides]

    def clear(self) -> None:
        """Zeros in both buffers: a page the row does not reach is read from them, masked (0 x what they held)."""
        self.pool_buf[...] = jnp.zeros_like(self.pool_buf)
        if self.scales_buf is not None:
            self.scales_buf[...] = jnp.zeros_like(self.scales_buf)

    def block(self, slot):
        """Buffer `slot`'s pages as one run of positions ([pages_per_block x page_size, hd] float32)."""
        pages, page_size, hd = self.pool_buf.shape[1:]
        return self.pool_buf[slot].astype(jnp.float32).reshape(pages * page_size, hd)

    def page(self, slot, j):
        """Page j of buffer `slot`, widened ([page_size, hd] float32), and its scales as a row ([1, page_size])."""
        return self.pool_buf[slot, j].astype(jnp.float32), self.scales_buf[slot, pl.ds(j, 1), :]


def _attend(lengths_ref, pages_ref, q_ref, *refs, pages_per_block, pages_per_row, scaled, scale):
    """One row's attention with one KV head's query group (q_ref, o_ref [groups, hd]), over its blocks of pages.
    `refs`: the pools (and an int8 pool's scales) in HBM, keys' then values', the output, then the scratch: the
    double buffers (keys', values'), their DMA semaphores, and which of the two buffers holds this block
    (`slot_ref`)."""
    per = 2 if scaled else 1  # a side's arrays: its pool, and an int8 pool's scales
    hbm, o_ref, buffers, (k_sems, v_sems, slot_ref) = refs[: 2 * per], refs[2 * per], refs[2 * per + 1 : -3], refs[-3:]

    def side(arrays, bufs, sems) -> _Cache:
        return _Cache(arrays[0], arrays[1] if scaled else None, bufs[0], bufs[1] if scaled else None, sems)

    keys, values = side(hbm[:per], buffers[:per], k_sems), side(hbm[per:], buffers[per:], v_sems)
    row, head = pl.program_id(0), pl.program_id(1)
    last_row, last_head = pl.num_programs(0) - 1, pl.num_programs(1) - 1
    page_size = keys.pool.shape[2]
    span = page_size * pages_per_block
    length = lengths_ref[row]

    def each_copy(row, head, block, slot, act):
        """act(copy) for the DMAs of one block of a row's pages that the row reaches: keys' and values'."""
        first = row * pages_per_row + block * pages_per_block
        for j in range(pages_per_block):
            page = pages_ref[first + j]
            reached = (block * pages_per_block + j) * page_size < lengths_ref[row]
            _when(reached, keys.copies(head, page, j, slot) + values.copies(head, page, j, slot), act)

    def start(row, head, block, slot):
        each_copy(row, head, block, slot, lambda copy: copy.start())

    @pl.when((row == 0) & (head == 0))
    def _first_block_of_the_call():
        keys.clear()
        values.clear()
        slot_ref[0] = 0
        start(row, head, 0, 0)

    blocks = jax.lax.div(length + span - 1, span)  # a truncating division: `//` lowers through sign()
    q = q_ref[...].astype(jnp.float32) * scale
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

        each_copy(row, head, i, slot, lambda copy: copy.wait())
        if scaled:
            for j in range(pages_per_block):
                (k, k_scales), (v, v_scales) = keys.page(slot, j), values.page(slot, j)
                carry = _tile(q, k, k_scales, v, v_scales, i * span + j * page_size, length, carry)
        else:
            carry = _tile(q, keys.block(slot), None, values.block(slot), None, i * span, length, carry)
        slot_ref[0] = other
        return carry

    column = jnp.zeros((groups, 1), jnp.float32)
    init = (column - jnp.inf, column, jnp.zeros((groups, hd), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, blocks, block, init)
    o_ref[...] = (acc / total).astype(o_ref.dtype)


def _when(condition, copies: list, act) -> None:
    """act(copy) for each of `copies` where `condition` holds (a DMA started, or waited for, only there)."""

    @pl.when(condition)
    def _act():
        for copy in copies:
            act(copy)


def _tile(q, keys, key_scales, values, value_scales, start, length, carry):
    """The running softmax (max, total, weighted values) carried over a tile of positions from `start`: its keys and
    values ([positions, hd] float32), an int8 page's with their scales ([1, positions]; None for a float cache)."""
    peak, total, acc = carry
    scores = jnp.einsum("gd,td->gt", q, keys, preferred_element_type=jnp.float32)
    if key_scales is not None:
        scores = scores * key_scales
    positions = start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(positions < length, scores, MASKED)
    new_peak = jnp.maximum(peak, scores.max(axis=-1, keepdims=True))
    p = jnp.exp(scores - new_peak)
    kept = jnp.exp(peak - new_peak)
    total = kept * total + p.sum(axis=-1, keepdims=True)
    weighted = p if value_scales is None else p * value_scales
    acc = kept * acc + jnp.einsum("gt,td->gd", weighted, values, preferred_element_type=jnp.float32)
    return new_peak, total, acc
