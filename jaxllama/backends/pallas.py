"""XLA's operations on a TPU or GPU, with a decode step's attention over a paged KV cache run by Pallas kernels (on a
TPU this project's `paged_attention.py`, JetStream's design reading only the pages a row reaches, bfloat16 or int8
with its scales; on a GPU jax's `...ops.gpu.paged_attention`): each row reads only its pages up to its own length, a
block of pages at a time, where XLA's gather reads every page of the table's width for every row. The kernels read
the pool as `core/paged_kv.py` lays it out ([kv_heads, pages, page_size, head_dim]), and an int8 cache's scales as
they are stored ([kv_heads, pages, page_size]).

The kernels run per device: inside a `shard_map` over the mesh's `model` axis, each device attends with its own
query heads over its own KV heads (the pool's heads are split over `model`, as the weights' are). A prompt's
attention (many queries a row), KV heads that the model axis does not split, a head_dim that is not a multiple of
128 (the TPU kernel's blocks end in whole 128-lane registers; Llama's is 128) take XLA's path.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxllama.backends import paged_attention
from jaxllama.core import int8_kv
from jaxllama.core.int8_kv import Int8KV
from jaxllama.core.ops import Ops
from jaxllama.core.sharding import activations_spec

LANES = 128  # a head's width must be a multiple of it
# Positions per page: a TPU's bfloat16 tile is [16, 128], and pages of a few tiles make whole DMA transfers for the
# kernels; a prefix is shared a page at a time.
PAGE_SIZE = 64
INT8_PAGE_SIZE = 128
MAX_PAGES_PER_BLOCK = 8  # pages a kernel reads at a time: with 64-position pages, 512 positions a block
# A prompt's attention runs the flash kernel from this many tokens: below, the kernel's layout ([heads, t] major, not
# XLA's [t, heads]) costs its transposes about what it saves (`jaxllama compile`, 8B on v5e:2x4 by cycles, the
# kernel's flops at peak added: 8 x 512 58.6 ms by XLA, 60.9 ms by the kernel; 1 x 1024 18.0 and 16.4 ms; 1 x 4095
# 101.9 and 63.7 ms).
FLASH_MIN_TOKENS = 1024
# A grouped product's tile of rows (`TpuOps.grouped`): the rows of a prefill's experts in tiles of 512, a decode
# step's fewer in one tile of their own.
GROUPED_ROWS_TILE = 512
GPU_SPLITS = 16  # the GPU kernel splits each row's pages into this many parts, run in parallel, then joined
# Pages the GPU kernel reads at a time: it holds a block's keys and values in shared memory, and 8 pages of 64
# positions of 128 bfloat16 numbers, keys and values, are 256 KiB, past the 227 KiB a block may have on an H100
# (`jaxllama compile --topology h100:8` refuses 8B at 8,192 positions so); 4 pages, 128 KiB.
GPU_MAX_PAGES_PER_BLOCK = 4
# No collective matmuls: the compiler splits a product whose input it all-gathers, or whose output it
# reduce-scatters, into a loop of pieces that overlap the transfers, which costs more cycles than it hides on these
# shapes (`jaxllama compile`, prefill 8 x 512: 8B bf16 on v5e:2x4 and 70B int8 on v5e:4x4; axlearn turns them off on
# v6e for the same reason).
TPU_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    # No cross-program prefetch: the compiler prefetches one weight into VMEM before a program starts and again at
    # its end, for the next run, which pays only where the next run is handed the same buffer. A decode step runs
    # one program over each run of `layers_per_program` layers, every run handed other weights, so the second read
    # is waste: 70B int8 on v5e:4x4, 8 rows, 5 layers' HBM traffic 339 -> 316 MB by the compiler's own count.
    "xla_max_cross_program_prefetches": 0,
}
# Scoped VMEM a fused product may tile into, by `device_kind`: 96 MiB of a v6e's 128 (as MaxText and axlearn set
# it; the default tiles a 70B prefill's down projections at 1.7x their ideal cycles, 1.15x with it). A v5e's
# products gain nothing from more.
SCOPED_VMEM_KIB = {"TPU v6 lite": {"xla_tpu_scoped_vmem_limit_kib": 98304}}


@dataclasses.dataclass(frozen=True)
class PallasOps(Ops):
    """XLA's operations on an accelerator (`float32_products`), a decode step's attention over pages by a kernel."""

    float32_products: bool = dataclasses.field(default=True, kw_only=True)
    # Rotary pairs as halves of each head (`rope.rope_halves_order`): pairs (2i, 2i+1) end in a dimension of 2, which a
    # TPU pads to its 128 lanes and copies to stack (`jaxllama compile`, 70B on v6e:2x4, prefill 8 x 512: ~4% of the
    # cycles; 70B int8 decode on v5e:4x4 143.9 -> 149.2 tok/s per sequence with the other changes of that commit).
    rope_halves: bool = dataclasses.field(default=True, kw_only=True)
    # Tested on a CPU in Pallas's interpreter (the kernel's own code, run as jax operations).
    interpret: bool = dataclasses.field(default=False, kw_only=True)

    def page_size(self, cache_dtype) -> int:
        """Paged in every cache dtype: a kernel reads each of them, int8 pages with their scales."""
        return PAGE_SIZE

    def gated(self, x, p: dict, gate: str, up: str) -> jax.Array:
        """silu(x @ gate) * (x @ up), computed once: held apart by an optimization barrier from the down projection
        that reads it, into whose input the TPU compiler fuses it otherwise and computes it again for every tile of
        that product's output (70B on v6e:2x4, prefill 8 x 512: its down projections at 1.7-2.0x their cycles)."""
        h = super().gated(x, p, gate, up)
        # as the 2-D rows the next product reads: a barrier on [b, t, ffn] leaves it a 3-D product, tiled worse
        return jax.lax.optimization_barrier(h.reshape(-1, h.shape[-1])).reshape(h.shape)

    def paged_attention(self, q, pool_k, pool_v, positions, table) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        model = 1 if mesh.empty or "model" not in mesh.axis_names else mesh.shape["model"]
        kv_heads, head_dim = pool_k.shape[0], pool_k.shape[-1]
        if q.shape[1] != 1 or kv_heads % model or head_dim % LANES:
            return super().paged_attention(q, pool_k, pool_v, positions, table)
        b, _, kv, g, hd = q.shape
        queries = q[:, 0].reshape(b, kv * g, hd)  # head kv_index * g + group
        lengths = positions[:, 0].astype(jnp.int32) + 1
        pages = jnp.minimum(table, pool_k.shape[1] - 1)  # a page not given out: any page, past the row's length
        attend = functools.partial(self._kernel, scale=1.0 / math.sqrt(hd))
        if model > 1:
            heads, replicated, pools = PartitionSpec(None, "model", None), PartitionSpec(), PartitionSpec("model")
            attend = jax.shard_map(
                attend,
                mesh=mesh,
                in_specs=(heads, *(jax.tree.map(lambda _: pools, p) for p in (pool_k, pool_v)), replicated, replicated),
                out_specs=heads,
                check_vma=False,
            )
        out = attend(queries, pool_k, pool_v, lengths, pages)
        return out.reshape(b, 1, kv, g, hd).astype(q.dtype)

    def _kernel(self, q, pool_k, pool_v, lengths, pages, scale: float) -> jax.Array:
        """q [b, heads, hd] (its scores scaled by `scale`), one device's pools, lengths [b], pages [b, n] -> [b,
        heads, hd]."""
        raise NotImplementedError

    def kernel_read(self, length: int, page_size: int) -> int:
        """Whole pages up to the row's length (`paged_attention.py` copies no page the row does not reach)."""
        return -(-length // page_size) * page_size


@dataclasses.dataclass(frozen=True)
class TpuOps(PallasOps):
    def page_size(self, cache_dtype) -> int:
        """An int8 cache's pages hold 128 positions: its scales ([kv_heads, pages, page_size] float32) are tiled 128
        to a row, and pages of 64 would store and read each row twice its bytes."""
        return INT8_PAGE_SIZE if int8_kv.is_int8(cache_dtype) else PAGE_SIZE

    def compiler_options(self, program: str, device) -> dict:
        """The TPU compiler's options for every program: no collective matmuls and no cross-program prefetch
        (`TPU_OPTIONS`), and on some chips more scoped VMEM (`SCOPED_VMEM_KIB`); none for another compiler (a CPU
        mesh running the kernels in Pallas's interpreter)."""
        if device.platform != "tpu":
            return {}
        return TPU_OPTIONS | SCOPED_VMEM_KIB.get(device.device_kind, {})

    def prompt_attention(self, q, k, v) -> jax.Array | None:
        """A fresh prompt's attention by jax's TPU flash-attention kernel (`pallas.ops.tpu.flash_attention`, causal):
        blocks of queries against blocks of keys on the matrix unit, the softmax carried across blocks, where XLA
        holds every row's [heads, t, t] scores and runs the softmax over them on the vector unit (a 70B prefill of
        8 x 512 on v6e:2x4 spent ~13% of its cycles there). Each device runs its own prompts where `model` splits
        them (`sharding.activations_spec`), else its own query heads. For prompts shorter than FLASH_MIN_TOKENS, where
        the mesh has a `data` axis of more than one device, heads the model axis does not split (prompts it does not
        split), heads not 128 wide or prompts not a multiple of 128 tokens, XLA's attention runs."""
        from jax.experimental.pallas.ops.tpu import flash_attention as flash

        b, t, kv, g, hd = q.shape
        mesh = jax.sharding.get_abstract_mesh()
        axes = {} if mesh.empty else dict(mesh.shape)
        model = axes.get("model", 1)
        block = next((n for n in (512, 256, 128) if t % n == 0), None)
        by_prompt = activations_spec(q.shape, axes) == PartitionSpec("model", None)  # None on one device
        if t < FLASH_MIN_TOKENS or block is None or hd % LANES or axes.get("data", 1) > 1:
            return None
        if kv % model and not by_prompt:
            return None
        heads = lambda x: x.transpose(0, 2, 1, 3)  # [b, t, heads, hd] <-> [b, heads, t, hd]
        queries = heads(q.reshape(b, t, kv * g, hd))  # head kv_index * g + group
        keys, values = (heads(jnp.repeat(x, g, axis=2)) for x in (k, v))
        blocks = flash.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1)  # the forward pass's
        attend = functools.partial(flash.flash_attention, causal=True, sm_scale=1.0 / math.sqrt(hd), block_sizes=blocks)
        if model > 1:
            split = PartitionSpec("model") if by_prompt else PartitionSpec(None, "model")  # [b, heads, t, hd]
            attend = jax.shard_map(attend, mesh=mesh, in_specs=(split,) * 3, out_specs=split, check_vma=False)
        return heads(attend(queries, keys, values)).reshape(q.shape).astype(q.dtype)

    def grouped(self, rows: jax.Array, w: jax.Array, sizes: jax.Array, row_parallel: bool = False) -> jax.Array:
        """A mixture of experts' products by jax's megablox kernel (`pallas.ops.tpu.megablox.gmm`, as MaxText runs
        Mixtral): tiles of each group's rows against its own weights alone, where XLA's `ragged_dot` computes every
        group's weights against every row, masked (Mixtral-8x7B on v5e:4x4, a prefill of 8 x 512: 33x its ideal).
        Each device runs its own part of the weights' `model` axis: its outputs' part (a column-parallel product), or
        of its inputs, the partial sums then summed over the axis (`row_parallel`). Rows are padded to a whole tile,
        the padding given to the last group. Widths not a multiple of 128 on each device, or a mesh with a `data`
        axis of more than one device, take XLA's path."""
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        mesh = jax.sharding.get_abstract_mesh()
        axes = {} if mesh.empty else dict(mesh.shape)
        model = axes.get("model", 1)
        (m, n_in), n_out = rows.shape, w.shape[1]
        local_in, local_out = (n_in // model, n_out) if row_parallel else (n_in, n_out // model)
        if local_in % LANES or local_out % LANES or n_in % model or n_out % model or axes.get("data", 1) > 1:
            return super().grouped(rows, w, sizes, row_parallel)
        tiles = tuple(next(t for t in (512, 256, 128) if n % t == 0) for n in (local_in, local_out))
        rows_tile = min(GROUPED_ROWS_TILE, -(-m // 16) * 16)  # a whole number of bfloat16 tiles ([16, 128])
        pad = -m % rows_tile
        padded, sizes = jnp.pad(rows, ((0, pad), (0, 0))), sizes.at[-1].add(pad)

        def product(a, b, groups):
            out = gmm(a, b, groups, rows.dtype, (rows_tile, *tiles), transpose_rhs=True, interpret=self.interpret)
            return jax.lax.psum(out, "model") if row_parallel and model > 1 else out

        if model > 1:
            if row_parallel:  # each device its inputs' part: rows [m, in] and weights [groups, out, in] by inputs
                specs, out_spec = (PartitionSpec(None, "model"), PartitionSpec(None, None, "model")), PartitionSpec()
            else:  # each device its outputs' part of every row
                specs, out_spec = (PartitionSpec(), PartitionSpec(None, "model")), PartitionSpec(None, "model")
            product = jax.shard_map(
                product, mesh=mesh, in_specs=(*specs, PartitionSpec()), out_specs=out_spec, check_vma=False
            )
        return product(padded, w, sizes)[:m]

    def _kernel(self, q, pool_k, pool_v, lengths, pages, scale: float) -> jax.Array:
        block = math.gcd(pages.shape[1], MAX_PAGES_PER_BLOCK)
        return paged_attention.paged_attention(q, pool_k, pool_v, lengths, pages, pages_per_block=block, scale=scale)


@dataclasses.dataclass(frozen=True)
class GpuOps(PallasOps):
    def kernel_read(self, length: int, page_size: int) -> int:
        """Whole blocks of GPU_MAX_PAGES_PER_BLOCK pages: jax's GPU kernel copies every page of a row's last block
        (its blocks are that many pages, or fewer where a short table's parts have fewer: at most this)."""
        block = page_size * GPU_MAX_PAGES_PER_BLOCK
        return -(-length // block) * block

    def _kernel(self, q, pool_k, pool_v, lengths, pages, scale: float) -> jax.Array:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        (k, k_scales), (v, v_scales) = _split(pool_k), _split(pool_v)
        splits = math.gcd(pages.shape[1], GPU_SPLITS)
        block = math.gcd(pages.shape[1] // splits, GPU_MAX_PAGES_PER_BLOCK)
        return paged_attention(
            q * scale,
            k,
            v,
            pages,
            lengths,
            k_scales,
            v_scales,
            pages_per_compute_block=block,
            k_splits=splits,
            interpret=self.interpret,
        )


def _split(pool):
    return (pool.values, pool.scales) if isinstance(pool, Int8KV) else (pool, None)
