"""Matrix products against weights packed once into the layout of the CPU kernel `matmul.cc`, called from jitted code
through XLA's FFI once `library.load` has built and registered it.

`pack` turns a weight stored (out, in) into a `Packed` pytree; code that multiplies by a weight checks for one
(`core.model.linear`), so that a params tree with packed weights runs through the kernel without a switch.
`pack_gated` packs an MLP's gate and up projections as one product that gives silu(gate) x up. `quantize` turns
packed float32 panels into int8 ones with a scale per block of 32 inputs of each column (llama.cpp's Q8_0, to the
bit): 1.125 bytes a weight instead of 4, the bytes that bound a one-row product, in the layout of one of
QUANTIZATIONS.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxllama_matmul"
GATED_TARGET = "jaxllama_gated_matmul"
PANEL = 16  # output columns per panel (matmul.cc's kPanel); a gated product's panel: 8 gate and 8 up columns
Q_BLOCK = 32  # inputs per scale of a quantized weight (matmul.cc's kQBlock; Q8_0's block)
# What `quantize` makes: the names users pass (`Engine(quantize=...)`, `--quantize`). Both store the weights as Q8_0;
# "q8_0" multiplies them by the inputs quantized to int16, "w8a8" by the inputs quantized to int8 (Q8_0 too, as
# llama.cpp's products do), which AVX-512 VNNI sums at four times the rate of float32 FMAs.
QUANTIZATIONS = ("q8_0", "w8a8")


def check_quantization(name: str | None) -> None:
    """Raise ValueError unless name is None (float32 weights) or one of QUANTIZATIONS."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantize={name!r}: expected one of {', '.join(QUANTIZATIONS)} or None")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """One weight [*out, *in], or several sharing their input dims, as panels [ceil(out / PANEL), in, PANEL] of
    PANEL output columns each (the last zero-padded): each panel is one contiguous stream for the kernel. Several
    weights are one product, whose output `matmul` splits again (their out shapes: `out_shapes`). `gated`: a
    gate and an up projection (`pack_gated`), one output. Quantized (`quantize`): int8 panels [panels, in padded to
    whole blocks of Q_BLOCK, PANEL] holding their inputs in pairs (int8, "q8_0") or fours (uint8, q + 128,
    "w8a8"), column by column, and `scales` [panels, blocks, PANEL], each column's scale for each block."""

    panels: jax.Array
    out_shapes: tuple[tuple[int, ...], ...] = dataclasses.field(metadata={"static": True})
    gated: bool = dataclasses.field(default=False, metadata={"static": True})
    scales: jax.Array | None = None


@jax.jit(static_argnames="in_dims")
def pack(*weights: jax.Array, in_dims: int = 1) -> Packed:
    """Weights [*out, *in] (stored (out, in), `in_dims` trailing dims, the same for all) -> Packed."""
    n_in = int(np.prod(weights[0].shape[weights[0].ndim - in_dims :]))
    out_shapes = tuple(tuple(w.shape[: w.ndim - in_dims]) for w in weights)
    w = jnp.concatenate([w.reshape(-1, n_in) for w in weights])
    panels = -(-w.shape[0] // PANEL)
    w = jnp.pad(w, ((0, panels * PANEL - w.shape[0]), (0, 0)))
    return Packed(w.reshape(panels, PANEL, n_in).transpose(0, 2, 1), out_shapes)


@jax.jit
def pack_gated(gate: jax.Array, up: jax.Array) -> Packed:
    """An MLP's gate and up projections [hidden, in] -> one gated Packed product, whose `matmul` gives
    silu(x @ gate) x (x @ up): panel i holds gate outputs [8i, 8i + 8) and then the same up outputs."""
    hidden, n_in = gate.shape
    half = PANEL // 2
    panels = -(-hidden // half)
    gate, up = (jnp.pad(w, ((0, panels * half - hidden), (0, 0))).reshape(panels, half, n_in) for w in (gate, up))
    return Packed(jnp.concatenate([gate, up], axis=1).transpose(0, 2, 1), ((hidden,),), gated=True)


def quantize(w: Packed, name: str = "q8_0") -> Packed:
    """Float32 panels -> int8 ones and their scales, as llama.cpp quantizes a row of Q8_0 (ggml-quants.c, to the
    bit): per block of Q_BLOCK inputs of a column, scale = max |w| / 127 (stored as float16, here in float32) and
    q = w x (1 / that scale before its rounding to float16), rounded half away from zero. The inputs are padded
    with zeros to whole blocks and stored, column by column, in pairs as int8 ("q8_0": [panels, in / 2, PANEL, 2],
    as pmaddwd reads them) or in fours as q + 128 in uint8 ("w8a8": [panels, in / 4, PANEL, 4], as vpdpbusd reads
    them)."""
    check_quantization(name)
    q, scales = _quantize(w.panels, jnp.float32(127))  # a divisor XLA sees as a constant becomes a multiply
    n, kp, cols = q.shape
    group = 2 if name == "q8_0" else 4
    q = q.reshape(n, kp // group, group, cols).transpose(0, 1, 3, 2).reshape(n, kp, cols)
    return dataclasses.replace(
        w, panels=q if name == "q8_0" else (q.astype(jnp.int16) + 128).astype(jnp.uint8), scales=scales
    )


@jax.jit
def _quantize(panels: jax.Array, top: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[panels, in, PANEL] float32 -> int8 [panels, in padded to whole blocks, PANEL] and scales [panels, blocks,
    PANEL]."""
    n, k, cols = panels.shape
    blocks = -(-k // Q_BLOCK)
    padded = jnp.pad(panels, ((0, 0), (0, blocks * Q_BLOCK - k), (0, 0))).reshape(n, blocks, Q_BLOCK, cols)
    scale = jnp.max(jnp.abs(padded), axis=2, keepdims=True) / top
    inverse = jnp.where(scale == 0, 0, 1 / jnp.where(scale == 0, 1, scale))
    scaled = jnp.abs(padded * inverse)
    q = jnp.sign(padded) * (jnp.floor(scaled) + jnp.floor(2 * (scaled - jnp.floor(scaled))))  # ggml's roundf
    scales = scale.astype(jnp.float16).astype(jnp.float32).reshape(n, blocks, cols)
    return q.astype(jnp.int8).reshape(n, blocks * Q_BLOCK, cols), scales


def dequantize(w: Packed) -> np.ndarray:
    """A quantized Packed's weight as float32 [panels * PANEL, in padded to whole blocks]: what its products
    multiply by, a row per column of its panels (for a single weight, its (out, in) layout with padding)."""
    n, kp, cols = w.panels.shape
    group = 4 if w.panels.dtype == jnp.uint8 else 2
    q = np.asarray(w.panels).reshape(n, kp // group, cols, group).transpose(0, 1, 3, 2).reshape(n, kp, cols)
    q = q.astype(np.int16) - (128 if group == 4 else 0)
    weights = q.reshape(n, kp // Q_BLOCK, Q_BLOCK, cols).astype(np.float32) * np.asarray(w.scales)[:, :, None, :]
    return weights.reshape(n, kp, cols).transpose(0, 2, 1).reshape(n * cols, kp)


def matmul(x: jax.Array, w: Packed) -> jax.Array | tuple[jax.Array, ...]:
    """x [..., in] @ the packed weight -> [..., *out], or a tuple of them for several weights packed as one."""
    sizes = [int(np.prod(shape)) for shape in w.out_shapes]
    target = GATED_TARGET if w.gated else TARGET
    weights = (w.panels,) if w.scales is None else (w.panels, w.scales)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:-1], sum(sizes)), x.dtype))(x, *weights)
    lead = x.shape[:-1]
    if len(sizes) == 1:
        return out.reshape(*lead, *w.out_shapes[0])
    parts = jnp.split(out, np.cumsum(sizes)[:-1], axis=-1)
    return tuple(part.reshape(*lead, *shape) for part, shape in zip(parts, w.out_shapes, strict=True))
