"""Weights stored as llama.cpp stores Q8_0 and Q4_0: blocks of 32 consecutive inputs of one output, each a float16
scale `d` and 32 small integers `q`, the weight being d x q. A `Blocks` is one weight [*out, *in] in that form, as
a checkpoint holds it and as products read it (`Ops.linear` dequantizes inside the product; the CPU kernels read the
blocks as they are): a model stored at 8 or 4.5 bits a weight is never widened to float32 in memory.

- "q8_0": `quants` int8 [*out, n_in], q in [-127, 127];
- "q4_0": `quants` uint8 [*out, n_in // 2]: in block b, byte j holds q[32b + j] in its low nibble and q[32b + j + 16]
  in its high one, each stored as q + 8 (q in [-8, 7]), llama.cpp's order;
- `scales` float16 [*out, n_in // BLOCK]; n_in (the product of the `in_shape` dims) is a multiple of BLOCK.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # inputs per scale
FORMATS = ("q8_0", "q4_0")
# Bytes of one block in a GGUF file: the float16 scale, then the quants.
GGUF_BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """One weight [*out_shape, *in_shape] as blocks (see the module's docstring)."""

    quants: jax.Array
    scales: jax.Array
    format: str = dataclasses.field(metadata={"static": True})
    in_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.scales.shape[:-1])

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.out_shape, *self.in_shape)

    @property
    def nbytes(self) -> int:
        return self.quants.nbytes + self.scales.nbytes


def check_format(name: str) -> None:
    if name not in FORMATS:
        raise ValueError(f"block format {name!r}: expected one of {', '.join(FORMATS)}")


def unpack_quants(quants: jax.Array, format: str) -> jax.Array:
    """quants as stored -> int8 [*out, n_in], q itself."""
    if format == "q8_0":
        return quants
    low = (quants & 0xF).astype(jnp.int8) - 8
    high = (quants >> 4).astype(jnp.int8) - 8
    halves = (*quants.shape[:-1], -1, BLOCK // 2)  # per block: 16 bytes -> q[0:16] low, q[16:32] high
    return jnp.concatenate([low.reshape(halves), high.reshape(halves)], axis=-1).reshape(*quants.shape[:-1], -1)


def dequantize(w: Blocks, dtype=jnp.float32) -> jax.Array:
    """The weight [*out_shape, *in_shape] in `dtype` (d x q per block): jitted code fuses it into the product."""
    q = unpack_quants(w.quants, w.format).reshape(*w.out_shape, -1, BLOCK)
    values = q.astype(dtype) * w.scales.astype(dtype)[..., None]
    return values.reshape(w.shape)


def from_gguf(raw: np.ndarray, format: str, shape: tuple[int, ...], in_dims: int = 1) -> Blocks:
    """A GGUF tensor's raw block bytes (uint8, any shape holding them row by row) as Blocks of `shape` [*out, *in]
    (the last `in_dims` dims are the inputs), on the host: a view and two copies, no per-block Python."""
    check_format(format)
    out_shape, in_shape = tuple(shape[: len(shape) - in_dims]), tuple(shape[len(shape) - in_dims :])
    n_in = int(np.prod(in_shape))
    if n_in % BLOCK:
        raise ValueError(f"{format} weight of shape {shape}: {n_in} inputs is not a multiple of {BLOCK}")
    size = GGUF_BLOCK_BYTES[format]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(*out_shape, n_in // BLOCK, size)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    quants = blocks[..., 2:].reshape(*out_shape, -1).copy()
    return Blocks(quants.view(np.int8) if format == "q8_0" else quants, scales, format, in_shape)
