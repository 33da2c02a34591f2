"""The operations the model's math is written in, as one frozen value: products against weights, attention over the
KV cache, the greedy token of each row, and how weights are prepared for them.

`Ops` is XLA's implementation: the reference, and the default on every platform (GPU, TPU, a CPU mesh). Another
backend subclasses it and overrides what it runs better (the CPU kernels: `jaxllama/backends/cpu/`); the model takes
the value as an argument (`model.layers(..., ops=...)`) and never asks which one it has. A value is hashable and
compares by type and fields, so it can be a static argument of a jitted function.

Weights are stored (out, in), as every source format stores them, and applied as `x @ W.T`: one 2-D product per
weight, which XLA:CPU runs without transposing the weight on every call. XLA's products read a weight as it was
restored: in its own dtype (widened to the input's inside the product), or as `Blocks`, dequantized inside the
product, where XLA fuses the dequantization into the product's loops: no wider copy of the weight is ever stored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.core import int8_kv, int8_weights, paged_kv
from jaxllama.core.blocks import Blocks, dequantize
from jaxllama.core.cache_layout import POSITIONS_MAJOR, CacheLayout
from jaxllama.core.int8_weights import Int8
from jaxllama.core.products import HEAD_NORMS, PRODUCT_IN_DIMS, ROTATED, ROTATED_BIASES
from jaxllama.core.rope import rope_halves_order
from jaxllama.core.sharding import activations_spec

# XLA:CPU's option that turns its YNNPACK matrix-product kernels off (see `Ops.compiler_options`).
NO_YNNPACK = {"xla_cpu_experimental_ynn_fusion_type": ""}


@dataclasses.dataclass(frozen=True)
class Ops:
    """XLA's own operations. `prepared_on_host`: whether `prepare` makes new arrays in host memory (a CPU backend's
    packed weights), which a load may keep in a file and map back later (`engine/prepared.py`); XLA's read the
    restored arrays as they are. `float32_products`: attention's products of 16-bit operands give float32 (the
    matrix units of TPUs and GPUs accumulate in it; `ACCELERATOR`); XLA:CPU has no such product (BF16 x BF16 = F32
    is unimplemented there), so by default they give the operands' dtype, widened after."""

    float32_products: bool = dataclasses.field(default=False, kw_only=True)
    # Every product's weight as int8 with a scale per output channel (`int8_weights.py`), made at load.
    int8_weights: bool = dataclasses.field(default=False, kw_only=True)
    # Each head's dims of wq and wk reordered at load (`rope.rope_halves_order`) so that rotary pairs are halves.
    rope_halves: bool = dataclasses.field(default=False, kw_only=True)

    prepared_on_host: ClassVar[bool] = False
    # XLA's keys are positions-major, like the values: a decode step writes one vector per head in place and runs q.k
    # as a batched product (the matrix unit of a TPU or GPU), with no relayout of the cache.
    cache_layout: ClassVar[CacheLayout] = POSITIONS_MAJOR
    # Whether `attention` reads each query's row of the slots' cache in place, so that a prefill may run as one
    # packed batch of prompt tokens over that cache (`ModelRunner.prefill`). XLA's gathers each query's whole row.
    packed_prefill: ClassVar[bool] = False

    def prepare(self, params, config) -> dict:
        """params (the whole tree, or part of it) as this backend's products read them. XLA reads the checkpoint's
        weights as they are, or with `int8_weights` each product's weight quantized (blocks dequantized first; a
        weight quantized already is kept), and with `rope_halves` the heads' dims of wq and wk (and of their biases
        and per-head norms, in a family that has them) reordered. Every norm's scale is made float32, the dtype the
        norm computes in: a 16-bit scale would be widened again at every call (on a TPU, an op of its own each)."""
        if self.rope_halves:
            params = _rotated_halves(params, rope_halves_order(config.head_dim))
        params = _map_named(params, {"scale": lambda scale: scale if scale.dtype == F32 else scale.astype(F32)})
        if not self.int8_weights:
            return params
        return _map_products(params, lambda w, in_dims: w if isinstance(w, Int8) else _to_int8(w, in_dims=in_dims))

    def prepare_abstract(self, params, config) -> dict:
        """What `prepare` makes of abstract params (ShapeDtypeStructs with shardings): its shapes, dtypes and
        shardings, for programs compiled without weights."""
        widened = lambda s: s if s.dtype == F32 else jax.ShapeDtypeStruct(s.shape, F32, sharding=s.sharding)
        params = _map_named(params, {"scale": widened})
        if not self.int8_weights:
            return params
        return _map_products(
            params, lambda w, in_dims: w if isinstance(w, Int8) else int8_weights.abstract(_abstract_weight(w), in_dims)
        )

    def linear(self, x: jax.Array, w, in_dims: int = 1, row_parallel: bool = False) -> jax.Array:
        """x [..., *in] times w [*out, *in] (`in_dims` trailing dims; an array or `Blocks`) -> [..., *out], as one
        2-D product in x's dtype. `row_parallel`: the model axis splits the product's inputs (wo, w2), so that each
        device's outputs are partial sums, which a prompt's tokens [b, t, ...] reduce-scatter by token
        (`sharding.split_activations`)."""
        lead = x.shape[: x.ndim - in_dims]
        n_in = int(np.prod(w.shape[len(w.shape) - in_dims :]))
        out = w.shape[: len(w.shape) - in_dims]
        if isinstance(w, Int8):  # the int8 weight widened as the product reads it, its outputs scaled after
            q, scales, x2 = w.quants.reshape(-1, n_in).astype(x.dtype), w.scales.reshape(-1), x.reshape(-1, n_in)
            if not self.float32_products:
                y = jax.lax.dot_general(q, x2, (((1,), (1,)), ((), ()))).T
            else:
                # Summed in float32 inside the matrix unit, given in x's dtype: where the model axis splits the
                # inputs, the partial sums are all-reduced in 16 bits, half the bytes of float32's (a long prefill's
                # all-reduces bound it on a TPU slice), as a bfloat16 weight's product gives them. Scaled after, not
                # as the product reads the weight, even for a prompt's many rows: the scaled weight made the compiler
                # split the products into collective matmuls of 16 small pieces (`jaxllama compile`, 70B int8
                # prefill 8 x 512 on v5e:4x4: 386.1 ms by cycles, 293.5 scaled after).
                y = jax.lax.dot_general(x2, q, (((1,), (1,)), ((), ())), preferred_element_type=x.dtype)
            if (split := activations_spec(lead) if row_parallel else None) is not None:
                # Split by token before the scales: each device then scales its own tokens after the reduce-scatter,
                # where the compiler otherwise all-reduces the partial sums and scales every token on every device
                # (`jaxllama compile`, 70B int8 prefill 8 x 512 on v5e:4x4: 293.5 -> 224.8 ms by cycles).
                y = jax.lax.with_sharding_constraint(y.reshape(*lead, *out), split)
                return (y.astype(F32) * w.scales).astype(x.dtype)
            return (y.astype(F32) * scales).astype(x.dtype).reshape(*lead, *out)
        w = dequantize(w, x.dtype) if isinstance(w, Blocks) else w.astype(x.dtype)
        y = jax.lax.dot_general(w.reshape(-1, n_in), x.reshape(-1, n_in), (((1,), (1,)), ((), ()))).T
        return y.reshape(*lead, *out)

    def project(self, x: jax.Array, p: dict, names: Sequence[str], in_dims: int = 1) -> tuple[jax.Array, ...]:
        """x times each of the weights p[name] that share it as input."""
        return tuple(self.linear(x, p[name], in_dims) for name in names)

    def gated(self, x: jax.Array, p: dict, gate: str, up: str) -> jax.Array:
        """silu(x @ gate) * (x @ up): a feed-forward block's first half."""
        return jax.nn.silu(self.linear(x, p[gate])) * self.linear(x, p[up])

    def grouped(self, rows: jax.Array, w: jax.Array, sizes: jax.Array, row_parallel: bool = False) -> jax.Array:
        """rows [m, in], sorted by group, times their group's weights w [groups, out, in] (a mixture of experts'
        products, `core/moe.py`), group g's rows the sizes[g] after the groups before it -> [m, out]. XLA's
        `ragged_dot`; `row_parallel`: w's inputs are split over the mesh's `model` axis."""
        return jax.lax.ragged_dot_general(rows, w, sizes, _GROUPED, preferred_element_type=rows.dtype)

    def attention(self, q, cache_k, cache_v, positions, rows=None) -> jax.Array:
        """Each query against its row of the cache, up to its own position: q [b, t, kv, g, hd], cache_k and
        cache_v [n, kv, s, hd] (`cache_layout`), positions [b, t]; rows [b] the cache row of each batch row (an index
        >= n reads zeros), by default row i -> [b, t, kv, g, hd]. Scores, softmax and sums in float32 (products
        accumulate in it), as batched matrix products over the cached positions."""
        keys, values = cache_k, cache_v
        if rows is not None:  # this batch's rows, read in place: XLA fuses the gather into the attention loops.
            # (With mode="clip", a single row becomes a slice fused with the write, and XLA copies the cache.)
            take = lambda c: jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="fill", fill_value=0), c)
            keys, values = take(cache_k), take(cache_v)
        return self._blocked(q, keys, values, positions)

    def paged_attention(self, q, pool_k, pool_v, positions, table) -> jax.Array:
        """`attention` over a paged cache (`core/paged_kv.py`): pool_k and pool_v [kv, pages, page_size, hd], table
        [b, n] each row's pages. XLA's reads each row's n pages as one sequence (a gather) and attends over it; an
        accelerator's kernel reads only the pages a row has filled."""
        return self._blocked(q, paged_kv.gather(pool_k, table), paged_kv.gather(pool_v, table), positions)

    def prompt_attention(self, q, k, v) -> jax.Array | None:
        """A fresh prompt's attention by a kernel, or None where the backend has none (the model then attends over
        the cache it wrote): q [b, t, kv, g, hd], k and v [b, t, kv, hd] the prompt's own keys and values as the
        cache gives them back (`int8_kv.as_read`), every row's tokens at positions 0..t-1, each query seeing the keys
        up to its own."""
        return None

    def _blocked(self, q, keys, values, positions) -> jax.Array:
        """q [b, t, kv, g, hd] against its own row of keys and values [b, kv, s, hd], a block of queries at a time."""
        b, t = q.shape[:2]
        block = QUERY_BLOCK
        while t % block:
            block //= 2
        if t <= QUERY_BLOCK or block < QUERY_BLOCK // 4:
            return self._attend(q, keys, values, positions)
        # A long prompt's queries a block at a time: the scores held at once are [b, heads, block, s], not [b, heads,
        # t, s] (a 32k-token prompt's would not fit a TPU's memory); each query's own sums are the same.
        split = lambda x: x.reshape(b, t // block, block, *x.shape[2:]).swapaxes(0, 1)
        out = jax.lax.map(lambda qp: self._attend(qp[0], keys, values, qp[1]), (split(q), split(positions)))
        return out.swapaxes(0, 1).reshape(q.shape)

    def _attend(self, q, keys, values, positions) -> jax.Array:
        """One block of queries; keys and values arrays or `int8_kv.Int8KV` (each position's score times its key's
        scale, each probability times its value's: the int8 arrays widen inside the products)."""
        keys, key_scales = int8_kv.split(keys)
        values, value_scales = int8_kv.split(values)
        visible = jnp.arange(values.shape[2])[None, None, :] <= positions[:, :, None]  # [b, t, s]
        scores = self._product("btkgd,bksd->bkgts", q, keys.astype(q.dtype))
        if key_scales is not None:
            scores = scores * key_scales[:, :, None, None, :]
        scores = jnp.where(visible[:, None, None], scores * (1.0 / np.sqrt(q.shape[-1])), -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        if value_scales is not None:
            probs = probs * value_scales[:, :, None, None, :]
        return self._product("bkgts,bksd->btkgd", probs.astype(q.dtype), values.astype(q.dtype)).astype(q.dtype)

    def _product(self, spec: str, a, b) -> jax.Array:
        """einsum(spec, a, b) in float32 (see `float32_products`)."""
        if self.float32_products:
            return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
        return jnp.einsum(spec, a, b).astype(jnp.float32)

    def cache_dtype(self, activations):
        """The KV cache's dtype where none is asked for: the activations' (XLA's attention reads its cache in the
        dtype it computes in)."""
        return activations

    def page_size(self, cache_dtype) -> int:
        """Positions per page of the KV cache this backend reads fastest in `cache_dtype`, 0 for a contiguous cache.
        XLA's reads a paged cache by a gather of every page of the table's width: contiguous by default, paged only
        where asked (`Engine(page_size=...)`)."""
        return 0

    def kernel_read(self, length: int, page_size: int) -> int:
        """The positions a decode step's attention kernel reads of a row holding `length` positions of a paged cache
        (a job's clock charges a kernel its bytes, `engine/job_clock.py`). XLA's attention has no kernel: the
        compiler counts what its gather reads."""
        return length

    def greedy(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """logits [b, v] float32 -> (the most likely token [b] int32, the first on ties; its log-probability [b])."""
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, logprob_of(logits, tokens, self)

    def logsumexp(self, logits: jax.Array) -> jax.Array:
        """logits [..., v] float32 -> log sum exp over v [...]: what every reported log-probability subtracts. A
        backend that promises batch invariance computes each row alone (XLA's reduction over [b, v] may group a
        row's terms otherwise for another b)."""
        return jax.nn.logsumexp(logits, axis=-1)

    def compiler_options(self, program: str, device) -> dict:
        """XLA compiler options for one of the engine's programs (by its kind, e.g. "decode_layers") on `device`, the
        mesh's first (not the host's: a program may be compiled for devices elsewhere). XLA:CPU sets up its YNNPACK
        product kernels on each program's first call in a process: worth it for the decode layers, which run every
        step, not for prefills (most shapes run once or a few times) nor for the outputs (whose [rows, vocab]
        product XLA's own loops run faster)."""
        if device.platform != "cpu" or program == "decode_layers":
            return {}
        return NO_YNNPACK

    @property
    def custom_calls(self) -> tuple[str, ...]:
        """The FFI targets this backend's programs call (exported programs must be told they are expected)."""
        return ()


F32 = jnp.float32
# `Ops.grouped`'s product: rows [m, in] by weights [groups, out, in] (the checkpoints' (out, in)), rows grouped.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
QUERY_BLOCK = 1024  # a long prompt's queries attend this many at a time (`Ops.attention`)


def _map_named(params, fns: dict):
    """params with fns[key](value) at every key `fns` names, at any depth (in a run of layers: in each); the same
    tree (not a copy) where every fn gave back what it was given."""
    if isinstance(params, (list, tuple)):  # a run of layers
        out = [_map_named(p, fns) for p in params]
        return params if all(a is b for a, b in zip(out, params, strict=True)) else out
    out = {}
    for key, value in params.items():
        if key in fns:
            out[key] = fns[key](value)
        elif isinstance(value, dict):
            out[key] = _map_named(value, fns)
        else:
            out[key] = value
    return params if all(out[key] is value for key, value in params.items()) else out


def _map_products(params, fn, names=PRODUCT_IN_DIMS):
    """params with fn(weight, in_dims) at every product's weight of `names` (default: all of them, by name:
    `PRODUCT_IN_DIMS`; not the embedding)."""
    return _map_named(params, {name: lambda w, d=PRODUCT_IN_DIMS[name]: fn(w, d) for name in names})


def _rotated_halves(params, order):
    """params with each head's dims in `order` in every tensor laid out by the rotated queries' and keys' dims: wq
    and wk, their biases, their per-head norms."""
    reorder = functools.partial(_reorder_head_dims, order=order)
    norm = lambda n: {"scale": jnp.take(n["scale"], order)}
    return _map_named(params, dict.fromkeys(ROTATED + ROTATED_BIASES, reorder) | dict.fromkeys(HEAD_NORMS, norm))


@jax.jit
def _reorder_head_dims(w, order):
    """w [heads, head_dim, ...] (an array, `Blocks` or `Int8`: every array of it has its output's head dims second;
    or a bias [heads, head_dim]) with each head's dims in `order`."""
    return jax.tree.map(lambda a: jnp.take(a, order, axis=1), w)


@functools.partial(jax.jit, static_argnames="in_dims")
def _to_int8(w, in_dims: int) -> Int8:
    return int8_weights.quantize(dequantize(w, jnp.float32) if isinstance(w, Blocks) else w, in_dims)


def _abstract_weight(w) -> jax.ShapeDtypeStruct:
    """An abstract weight as floats (blocks: their weight's shape, sharded as their quants)."""
    if isinstance(w, Blocks):
        return jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=getattr(w.quants, "sharding", None))
    return w


def logprob_of(logits, tokens, ops: Ops):
    """log softmax(logits)[tokens], without writing out the whole [b, v] log-softmax."""
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return picked - ops.logsumexp(logits)


XLA = Ops()
ACCELERATOR = Ops(float32_products=True)  # XLA's operations on a TPU or GPU
