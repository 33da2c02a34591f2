"""Matrix products against weights packed once into the layout of the CPU kernel `matmul.cc`, called from jitted code
through XLA's FFI once `library.load` has built and registered it.

`pack` turns a weight stored (out, in) into a `Packed` pytree; code that multiplies by a weight checks for one
(`core.model.linear`), so that a params tree with packed weights runs through the kernel without a switch. It reads
each weight as stored: float32 and bfloat16 arrays stay float32 and bfloat16 panels (other floats become float32),
`Blocks` of Q8_0 and Q4_0 become int8 and Q4_0 panels holding the same bits. `pack_gated` packs an MLP's gate and up
projections as one product that gives silu(gate) x up. `quantize` turns float panels into int8 (llama.cpp's Q8_0,
to the bit) or Q4_0 ones with a scale per block of 32 inputs of each column, in the layout of one of QUANTIZATIONS.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.core.blocks import Blocks, unpack_quants

TARGET = "jaxllama_matmul"
GATED_TARGET = "jaxllama_gated_matmul"
PANEL = 16  # output columns per panel (matmul.cc's kPanel); a gated one: 8 gate and 8 up columns
Q_BLOCK = 32  # inputs per scale of a quantized weight (matmul.cc's kQBlock; Q8_0's and Q4_0's block)
# What `quantize` makes: the names users pass (`Engine(quantize=...)`, `--quantize`). "q8_0" and "w8a8" store the
# weights as Q8_0 (1.125 bytes a weight); "q8_0" multiplies them by the inputs quantized to int16, "w8a8" by the
# inputs quantized to int8 (Q8_0 too, as llama.cpp's products do), which AVX-512 VNNI sums at four times the rate of
# float32 FMAs. "q4_0" stores them as Q4_0 (0.5625 bytes a weight) and multiplies them by int8 inputs, as
# llama.cpp's `ggml_vec_dot_q4_0_q8_0`.
QUANTIZATIONS = ("q8_0", "w8a8", "q4_0")


def check_quantization(name: str | None) -> None:
    """Raise ValueError unless name is None (weights as stored) or one of QUANTIZATIONS."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantize={name!r}: expected one of {', '.join(QUANTIZATIONS)} or None")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """One weight [*out, *in], or several sharing their input dims, as panels of PANEL output columns each (the last
    zero-padded): each panel is one contiguous stream for the kernel. Several weights are one product, whose output
    `matmul` splits again (their out shapes: `out_shapes`). `gated`: a gate and an up projection (`pack_gated`), one
    output. What `panels` holds, by its dtype:
    - float32 [panels, in, PANEL];
    - bfloat16 [panels, in rounded up to even, PANEL]: each column's inputs in pairs, column by column;
    - quantized, with `scales` [panels, blocks of Q_BLOCK inputs, PANEL], each column's scale for each block: int8
      [panels, in padded to whole blocks, PANEL] holding the inputs in pairs ("q8_0"), uint8 of that shape holding
      them in fours as q + 128 ("w8a8"), both with float32 scales; or uint8 [panels, half that, PANEL] with float16
      scales (Q4_0): per 8 inputs of a column, 4 bytes whose low nibbles hold q + 8 of the first 4 and whose high
      ones those of the last 4."""

    panels: jax.Array
    out_shapes: tuple[tuple[int, ...], ...] = dataclasses.field(metadata={"static": True})
    gated: bool = dataclasses.field(default=False, metadata={"static": True})
    scales: jax.Array | None = None


def kind(w) -> str:
    """What a weight is stored as, for packing: "float32", "bfloat16" or a Blocks format."""
    if isinstance(w, Blocks):
        return w.format
    return "bfloat16" if w.dtype == jnp.bfloat16 else "float32"


@jax.jit(static_argnames=("in_dims", "layout"))
def pack(*weights, in_dims: int = 1, layout: str = "q8_0") -> Packed:
    """Weights [*out, *in] (stored (out, in), `in_dims` trailing dims, the same for all; arrays or Blocks, all of one
    `kind`) -> Packed. Q8_0 Blocks become the panels of `layout` ("q8_0" or "w8a8", as `quantize` names them)."""
    out_shapes = tuple(_out_shape(w, in_dims) for w in weights)
    return _lay_out([_rows(w, in_dims) for w in weights], out_shapes, False, layout)


@jax.jit(static_argnames="layout")
def pack_gated(gate, up, layout: str = "q8_0") -> Packed:
    """An MLP's gate and up projections [hidden, in] (arrays or Blocks of one kind) -> one gated Packed product,
    whose `matmul` gives silu(x @ gate) x (x @ up): panel i holds gate outputs [8i, 8i + 8) and then the same up
    outputs."""
    return _lay_out([_rows(gate, 1), _rows(up, 1)], (_out_shape(gate, 1),), True, layout)


def _out_shape(w, in_dims: int) -> tuple[int, ...]:
    return w.out_shape if isinstance(w, Blocks) else tuple(w.shape[: w.ndim - in_dims])


def _rows(w, in_dims: int) -> tuple[str, tuple[jax.Array, ...]]:
    """A weight as its kind and arrays with a row per output: (w [out, in],), or Blocks' (q [out, in] int8, scales
    [out, blocks] float16), q of Q4_0 as q + 8 in uint8."""
    if isinstance(w, Blocks):
        n_out = int(np.prod(w.out_shape))
        q = unpack_quants(w.quants, w.format).reshape(n_out, -1)
        if w.format == "q4_0":
            q = (q + 8).astype(jnp.uint8)
        return w.format, (q, w.scales.reshape(n_out, -1))
    n_in = int(np.prod(w.shape[w.ndim - in_dims :]))
    w = w.reshape(-1, n_in)
    return kind(w), (w if w.dtype in (jnp.float32, jnp.bfloat16) else w.astype(jnp.float32),)


def _arrange(arrays: list[jax.Array], gated: bool) -> jax.Array:
    """Rows of several weights [out_i, ...] as the rows of their panels [panels x PANEL, ...], zero-padded: one
    after another, or (gated: a gate and an up) 8 gate rows then the same 8 up rows in each panel."""
    if gated:
        half = PANEL // 2
        panels = -(-arrays[0].shape[0] // half)
        pad = [(0, panels * half - arrays[0].shape[0])] + [(0, 0)] * (arrays[0].ndim - 1)
        parts = [jnp.pad(a, pad).reshape(panels, half, *a.shape[1:]) for a in arrays]
        return jnp.concatenate(parts, axis=1).reshape(panels * PANEL, *arrays[0].shape[1:])
    rows = jnp.concatenate(arrays)
    pad = -rows.shape[0] % PANEL
    return jnp.pad(rows, [(0, pad)] + [(0, 0)] * (rows.ndim - 1))


def _lay_out(weights: list, out_shapes, gated: bool, layout: str) -> Packed:
    """`_rows` of one kind -> Packed."""
    kinds = {k for k, _ in weights}
    if len(kinds) != 1:
        raise ValueError(f"weights packed as one product must be stored alike, not as {sorted(kinds)}")
    (stored,) = kinds
    parts = [_arrange(list(arrays), gated) for arrays in zip(*(a for _, a in weights), strict=True)]
    if stored in ("float32", "bfloat16"):
        return Packed(_float_panels(parts[0]), out_shapes, gated)
    q, scales = parts
    return _quantized(q, scales, out_shapes, gated, layout if stored == "q8_0" else "q4_0")


def _float_panels(rows: jax.Array) -> jax.Array:
    """[panels x PANEL, in] float32 or bfloat16 -> panels (`Packed`)."""
    n, k = rows.shape
    if rows.dtype == jnp.float32:
        return rows.reshape(n // PANEL, PANEL, k).transpose(0, 2, 1)
    rows = jnp.pad(rows, ((0, 0), (0, k % 2)))
    return _interleave(rows.reshape(n // PANEL, PANEL, -1, 2))


def _interleave(groups: jax.Array) -> jax.Array:
    """[panels, PANEL, in / g, g] -> [panels, in, PANEL] holding each column's inputs in groups of g: a transpose of
    g-element words (bitcast to one wider integer each, which XLA transposes several times faster)."""
    panels, cols, n, g = groups.shape
    word = {2: jnp.uint16, 4: jnp.uint32}[g * groups.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(groups, word)
    out = jax.lax.bitcast_convert_type(words.transpose(0, 2, 1), groups.dtype)  # [panels, in / g, PANEL, g]
    return out.reshape(panels, n * g, cols)


def _quantized(q: jax.Array, scales: jax.Array, out_shapes, gated: bool, layout: str) -> Packed:
    """q [panels x PANEL, in padded to whole blocks] (int8; Q4_0: q + 8 in uint8) and scales [panels x PANEL,
    blocks] float16 -> the quantized Packed of `layout` (one of QUANTIZATIONS)."""
    n, kp = q.shape
    panels = n // PANEL
    scales = scales.reshape(panels, PANEL, -1).transpose(0, 2, 1)
    if layout == "q4_0":
        q = q.reshape(n, kp // 8, 2, 4)
        q = q[:, :, 0] | (q[:, :, 1] << 4)  # inputs 0..3 of each 8 in the low nibbles, 4..7 in the high ones
        q = _interleave(q.reshape(panels, PANEL, kp // 8, 4))
        return Packed(q, out_shapes, gated, scales.astype(jnp.float16))
    group = 2 if layout == "q8_0" else 4
    if layout == "w8a8":
        q = (q.astype(jnp.int16) + 128).astype(jnp.uint8)
    q = _interleave(q.reshape(panels, PANEL, kp // group, group))
    return Packed(q, out_shapes, gated, scales.astype(jnp.float32))


def quantize(w: Packed, name: str = "q8_0") -> Packed:
    """Float panels (float32 or bfloat16) -> quantized ones of layout `name` (one of QUANTIZATIONS), each column's
    inputs padded with zeros to whole blocks of Q_BLOCK and quantized per block as llama.cpp quantizes a row
    (ggml-quants.c): Q8_0 to the bit (scale = max |w| / 127, stored as float16; q = w x (1 / that scale before its
    rounding), rounded half away from zero), Q4_0 as `quantize_row_q4_0_ref` (scale = the w of largest |w| / -8,
    q + 8 = min(15, floor(w / scale + 8.5)))."""
    check_quantization(name)
    return _quantize_panels(w, name)


@jax.jit(static_argnames="name")
def _quantize_panels(w: Packed, name: str) -> Packed:
    panels, k, cols = w.panels.shape
    if w.panels.dtype == jnp.bfloat16:
        rows = w.panels.reshape(panels, k // 2, cols, 2).transpose(0, 2, 1, 3).reshape(panels * cols, k)
    else:
        rows = w.panels.transpose(0, 2, 1).reshape(panels * cols, k)
    q, scales = quantize_rows(rows.astype(jnp.float32), "q4_0" if name == "q4_0" else "q8_0")
    return _quantized(q, scales, w.out_shapes, w.gated, name)


def quantize_rows(rows: jax.Array, format: str) -> tuple[jax.Array, jax.Array]:
    """rows [n, in] float32 -> (q [n, in padded to whole blocks], scales [n, blocks] float16) of `format` ("q8_0":
    q int8; "q4_0": q + 8 in uint8), as `quantize` says."""
    n, k = rows.shape
    blocks = -(-k // Q_BLOCK)
    x = jnp.pad(rows, ((0, 0), (0, blocks * Q_BLOCK - k))).reshape(n, blocks, Q_BLOCK)
    if format == "q4_0":
        top = jnp.take_along_axis(x, jnp.argmax(jnp.abs(x), axis=-1, keepdims=True), axis=-1)
        scale = top / -8
        inverse = jnp.where(scale == 0, 0, 1 / jnp.where(scale == 0, 1, scale))
        q = jnp.clip(jnp.floor(x * inverse + 8.5), 0, 15).astype(jnp.uint8)
    else:
        scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / _divisor(127)
        inverse = jnp.where(scale == 0, 0, 1 / jnp.where(scale == 0, 1, scale))
        scaled = jnp.abs(x * inverse)
        q = (jnp.sign(x) * (jnp.floor(scaled) + jnp.floor(2 * (scaled - jnp.floor(scaled))))).astype(jnp.int8)
    return q.reshape(n, blocks * Q_BLOCK), scale.reshape(n, blocks).astype(jnp.float16)


def _divisor(value: float) -> jax.Array:
    """value as a number XLA cannot see as a constant: a division by a constant becomes a multiply by its inverse,
    which rounds differently from llama.cpp's division."""
    return jax.lax.optimization_barrier(jnp.float32(value))


def dequantize(w: Packed) -> np.ndarray:
    """A quantized Packed's weight as float32 [panels * PANEL, in padded to whole blocks]: what its products
    multiply by, a row per column of its panels (for a single weight, its (out, in) layout with padding)."""
    n, k, cols = w.panels.shape
    panels = np.asarray(w.panels)
    if w.scales.dtype == jnp.float16:  # Q4_0: two nibbles a byte
        low, high = (panels & 0xF).astype(np.int16) - 8, (panels >> 4).astype(np.int16) - 8
        split = [a.reshape(n, k // 4, cols, 1, 4) for a in (low, high)]
        q = np.concatenate(split, axis=3).reshape(n, k // 4, cols, 8).transpose(0, 1, 3, 2).reshape(n, 2 * k, cols)
    else:
        group = 4 if w.panels.dtype == jnp.uint8 else 2
        q = panels.reshape(n, k // group, cols, group).transpose(0, 1, 3, 2).reshape(n, k, cols)
        q = q.astype(np.int16) - (128 if group == 4 else 0)
    kp = q.shape[1]
    scales = np.asarray(w.scales).astype(np.float32)
    weights = q.reshape(n, kp // Q_BLOCK, Q_BLOCK, cols).astype(np.float32) * scales[:, :, None, :]
    return weights.reshape(n, kp, cols).transpose(0, 2, 1).reshape(n * cols, kp)


def matmul(x: jax.Array, w: Packed) -> jax.Array | tuple[jax.Array, ...]:
    """x [..., in] @ the packed weight -> [..., *out] in x's dtype, or a tuple of them for several weights packed as
    one. The kernel reads and writes float32 (a model computing in bfloat16 rounds the results to it)."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    sizes = [int(np.prod(shape)) for shape in w.out_shapes]
    target = GATED_TARGET if w.gated else TARGET
    weights = (w.panels,) if w.scales is None else (w.panels, w.scales)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:-1], sum(sizes)), x.dtype))(x, *weights)
    out = out.astype(dtype)
    lead = x.shape[:-1]
    if len(sizes) == 1:
        return out.reshape(*lead, *w.out_shapes[0])
    parts = jnp.split(out, np.cumsum(sizes)[:-1], axis=-1)
    return tuple(part.reshape(*lead, *shape) for part, shape in zip(parts, w.out_shapes, strict=True))
