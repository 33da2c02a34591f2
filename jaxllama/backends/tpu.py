"""XLA's operations on a TPU, with a decode step's attention over a paged KV cache run by jax's own Pallas kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`, JetStream's): each row reads only the pages up to its own
length, in blocks of pages copied into the core's memory while the previous block is summed, where XLA's gather
reads every page of the table's width for every row.

The kernel runs per device: inside a `shard_map` over the mesh's `model` axis, each device attends with its own
query heads over its own KV heads (the pool's heads are split over `model`, as the weights' are). A prompt's
attention (many queries a row), an int8 cache, KV heads that the model axis does not split, or a head_dim that is
not a multiple of 128 (the kernel's blocks: Llama's is 128) take XLA's path.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxllama.core.int8_kv import Int8KV
from jaxllama.core.ops import Ops

LANES = 128  # the kernel's blocks end in whole vector registers of 128 lanes: head_dim a multiple of it
MAX_PAGES_PER_BLOCK = 8  # pages the kernel copies in at a time: with 64-position pages, 512 positions a block


@dataclasses.dataclass(frozen=True)
class TpuOps(Ops):
    """XLA's operations on a TPU (`float32_products`), decode attention over pages by the Pallas kernel."""

    float32_products: bool = dataclasses.field(default=True, kw_only=True)

    def paged_attention(self, q, pool_k, pool_v, positions, table) -> jax.Array:
        if q.shape[1] != 1 or isinstance(pool_k, Int8KV):
            return super().paged_attention(q, pool_k, pool_v, positions, table)
        mesh = jax.sharding.get_abstract_mesh()
        model = 1 if mesh.empty or "model" not in mesh.axis_names else mesh.shape["model"]
        kv_heads, head_dim = pool_k.shape[0], pool_k.shape[-1]
        if kv_heads % model or head_dim % LANES:
            return super().paged_attention(q, pool_k, pool_v, positions, table)
        b, _, kv, g, hd = q.shape
        queries = (q[:, 0] * (1.0 / math.sqrt(hd))).reshape(b, kv * g, hd)  # head kv_index * g + group
        lengths = positions[:, 0].astype(jnp.int32) + 1
        pages = jnp.minimum(table, pool_k.shape[1] - 1)  # a page not given out: any page, past the row's length
        width = table.shape[1]
        block = math.gcd(width, MAX_PAGES_PER_BLOCK)
        attend = lambda q, k, v, lengths, pages: _paged_attention_kernel(q, k, v, lengths, pages, block)
        if model > 1:
            heads, replicated = PartitionSpec(None, "model", None), PartitionSpec()
            attend = jax.shard_map(
                attend,
                mesh=mesh,
                in_specs=(heads, PartitionSpec("model"), PartitionSpec("model"), replicated, replicated),
                out_specs=heads,
                check_vma=False,
            )
        out = attend(queries, pool_k, pool_v, lengths, pages)
        return out.reshape(b, 1, kv, g, hd).astype(q.dtype)


def _paged_attention_kernel(q, k_pages, v_pages, lengths, pages, block: int):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(q, k_pages, v_pages, lengths, pages, pages_per_compute_block=block)
