"""Reading a compiled program's HBM traffic and collectives from its optimized HLO (`engine/hlo.py`), checked against
programs whose bytes are known: compiled by XLA for this host's CPU devices, so that the HLO is the compiler's own."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllama.core import ops
from jaxllama.engine import aot, hlo
from tests.engine.test_aot import needs_libtpu


def _compiled_text(fn, *args, donate=()):
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()


def test_a_product_moves_its_operands_and_its_result():
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    w = jax.ShapeDtypeStruct((1024, 2048), jnp.float32)
    traffic = hlo.program_traffic(_compiled_text(lambda x, w: x @ w, x, w))
    ideal = (8 * 1024 + 1024 * 2048 + 8 * 2048) * 4
    assert ideal <= traffic.hbm_bytes <= 1.1 * ideal
    assert traffic.collectives == {}


def test_a_write_in_place_moves_the_update_not_the_buffer():
    cache = jax.ShapeDtypeStruct((64, 4096, 128), jnp.float32)  # 128 MiB
    row = jax.ShapeDtypeStruct((64, 1, 128), jnp.float32)
    position = jax.ShapeDtypeStruct((), jnp.int32)

    def write(cache, row, position):
        return jax.lax.dynamic_update_slice_in_dim(cache, row, position, axis=1)

    traffic = hlo.program_traffic(_compiled_text(write, cache, row, position, donate=(0,)))
    assert traffic.hbm_bytes <= 4 * 64 * 128 * 4  # a few times the row, nowhere near the cache's 128 MiB


def test_a_sliced_operand_moves_the_slice():
    table = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)  # 16 MiB
    index = jax.ShapeDtypeStruct((), jnp.int32)

    def row_sum(table, i):
        return jax.lax.dynamic_slice_in_dim(table, i, 1, axis=0).sum() * 2.0

    traffic = hlo.program_traffic(_compiled_text(row_sum, table, index))
    assert traffic.hbm_bytes < 1024 * 4 * 4


def test_collectives_are_counted_with_their_bytes():
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    x = jax.ShapeDtypeStruct((16, 512), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "model")))
    w = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("model", None)))
    traffic = hlo.program_traffic(_compiled_text(lambda x, w: x @ w, x, w))
    assert traffic.collectives["all-reduce"]["count"] >= 1
    assert traffic.collectives["all-reduce"]["bytes"] >= 16 * 256 * 4


def test_a_loop_body_counts_once_per_trip():
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)

    def looped(x):
        return jax.lax.fori_loop(0, 10, lambda i, y: jnp.sin(y) @ jnp.ones((1024, 1024), jnp.float32) / 1024, x)

    once = hlo.program_traffic(_compiled_text(lambda x: jnp.sin(x) @ jnp.ones((1024, 1024)) / 1024, x))
    traffic = hlo.program_traffic(_compiled_text(looped, x))
    assert traffic.hbm_bytes >= 5 * once.hbm_bytes


def test_a_loop_the_compiler_gives_no_trip_count_is_counted_from_its_condition():
    """TPU programs' loops (a long prompt's blocks of queries, the compiler's collective matmuls) come without a
    known trip count: it is read from the loop itself (a counter from a constant, by a constant step, below a
    constant)."""
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)

    def looped(x):
        step = lambda c: (c[0] + 2, jnp.sin(c[1]) @ jnp.ones((1024, 1024), jnp.float32) / 1024)
        return jax.lax.while_loop(lambda c: c[0] < 10, step, (0, x))[1]  # 5 trips

    once = hlo.program_traffic(_compiled_text(lambda x: jnp.sin(x) @ jnp.ones((1024, 1024)) / 1024, x))
    text = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", _compiled_text(looped, x))
    loop = next(i for i in hlo.Module(text).computations[hlo.Module(text).entry] if i.opcode == "while")
    assert loop.config_number("known_trip_count") == 0  # as a TPU program's loops come
    traffic = hlo.program_traffic(text)
    assert 4 * once.hbm_bytes <= traffic.hbm_bytes <= 6 * once.hbm_bytes


@needs_libtpu
def test_a_pallas_kernel_is_charged_its_operands_and_counted_apart():
    """jax's paged-attention kernel compiled for a TPU: a custom call, charged the whole pool its operands name (it may
    read less: a row's pages up to its length), and those bytes counted apart, for the job clock to scale."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    device = aot.target_devices("v5e:1x1")[0][0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shape = lambda s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=sharding)
    q, pool = shape((8, 8, 128)), shape((8, 256, 64, 128))  # 8 rows, 8 heads; 256 pages of 64 positions
    lengths, pages = shape((8,), jnp.int32), shape((8, 32), jnp.int32)
    attend = lambda q, k, v, lengths, pages: paged_attention(q, k, v, lengths, pages, pages_per_compute_block=8)
    traffic = hlo.program_traffic(jax.jit(attend).lower(q, pool, pool, lengths, pages).compile().as_text())
    assert 2 * 8 * 256 * 64 * 128 * 2 <= traffic.kernel_bytes <= traffic.hbm_bytes


@needs_libtpu
def test_a_ragged_product_the_compiler_cannot_cost_is_charged_its_flops():
    """A mixture of experts' `ragged_dot` compiled for a TPU: the compiler marks the fusion it lowers to as having no
    cycle estimate (INT64_MAX); its product is counted apart, every group's weights against every row, and adds no
    cycles."""
    device = aot.target_devices("v5e:1x1")[0][0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shape = lambda s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=sharding)
    rows, weights, sizes = shape((128, 512)), shape((8, 256, 512)), shape((8,), jnp.int32)  # weights (out, in)
    text = jax.jit(ops.XLA.grouped).lower(rows, weights, sizes).compile().as_text()
    traffic = hlo.program_traffic(text)
    assert "9223372036854775807" in text
    assert traffic.uncosted_flops == 2 * 128 * 8 * 256 * 512
    assert traffic.cycles < 2**40


@needs_libtpu
def test_the_megablox_kernel_is_charged_each_row_against_its_own_groups_weights():
    """A mixture of experts' product by jax's megablox kernel compiled for a TPU (`TpuOps.grouped`): a custom call the
    compiler gives no cycles, counted apart at 2 m n k (not every group's weights against every row, as XLA's
    `ragged_dot` computes them)."""
    from jaxllama.backends.pallas import TpuOps

    device = aot.target_devices("v5e:1x1")[0][0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shape = lambda s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=sharding)
    rows, weights, sizes = shape((256, 512)), shape((4, 256, 512)), shape((4,), jnp.int32)  # weights (out, in)
    traffic = hlo.program_traffic(jax.jit(TpuOps().grouped).lower(rows, weights, sizes).compile().as_text())
    assert traffic.uncosted_flops == 2 * 256 * 256 * 512
    assert traffic.kernel_bytes >= 4 * 256 * 512 * 2  # every group's weights read
