"""Weights as int8 with one scale per output channel, for XLA's products on accelerators (`Ops(int8_weights=True)`,
`--quantize int8`): a decode step reads half the bytes of bfloat16, and the product converts the int8 weight to the
activations' dtype as it fetches it and scales its outputs, so it costs the matrix unit what bfloat16 does. Blocks
of 32 (Q8_0, `blocks.py`) read as many bytes but multiply every weight by its block's scale inside the product,
which compiled for a TPU took 13x the cycles of bfloat16's (benchmarks/README.md).

`Int8(quants, scales)`: quants int8 [*out, *in], w ~= quants * scales[..., None]; scales float32 [*out], the largest
|w| of the output channel over 127 (symmetric, as jax-llm-examples and llama.cpp's Q8_0 round).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8:
    """One weight [*out, *in] as int8 quants and a float32 scale per output channel (`in_dims` trailing dims)."""

    quants: jax.Array
    scales: jax.Array
    in_dims: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.quants.shape)


def quantize(w: jax.Array, in_dims: int = 1) -> Int8:
    """w [*out, *in] (floats) -> Int8, rounding each output channel to 255 levels of its largest magnitude."""
    w = w.astype(jnp.float32)
    axes = tuple(range(w.ndim - in_dims, w.ndim))
    amax = jnp.max(jnp.abs(w), axis=axes)
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    quants = jnp.clip(jnp.round(w / scales.reshape(*scales.shape, *([1] * in_dims))), -127, 127).astype(jnp.int8)
    return Int8(quants, scales, in_dims)


def dequantize(w: Int8, dtype=jnp.float32) -> jax.Array:
    """The weight as floats of `dtype`."""
    scales = w.scales.reshape(*w.scales.shape, *([1] * w.in_dims))
    return (w.quants.astype(jnp.float32) * scales).astype(dtype)


def abstract(w: jax.ShapeDtypeStruct, in_dims: int) -> Int8:
    """The Int8 of an abstract weight (its shape and sharding): quants sharded as the weight, scales as its outputs."""
    out = w.shape[: len(w.shape) - in_dims]
    sharding = getattr(w, "sharding", None)
    scale_sharding = None
    if sharding is not None:
        spec = tuple(sharding.spec) + (None,) * (len(w.shape) - len(sharding.spec))
        scale_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[: len(out)]))
    quants = jax.ShapeDtypeStruct(w.shape, jnp.int8, sharding=sharding)
    return Int8(quants, jax.ShapeDtypeStruct(out, jnp.float32, sharding=scale_sharding), in_dims)
