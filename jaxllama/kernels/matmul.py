"""Matrix products against weights packed once into the layout of the CPU kernel `matmul.cc`, called from jitted code
through XLA's FFI once `library.load` has built and registered it.

`pack` turns a weight stored (out, in) into a `Packed` pytree; code that multiplies by a weight checks for one
(`core.model.linear`), so that a params tree with packed weights runs through the kernel without a switch.
`pack_gated` packs an MLP's gate and up projections as one product that gives silu(gate) x up.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxllama_matmul"
GATED_TARGET = "jaxllama_gated_matmul"
PANEL = 16  # output columns per panel (matmul.cc's kPanel); a gated product's panel: 8 gate and 8 up columns


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """One weight [*out, *in], or several sharing their input dims, as panels [ceil(out / PANEL), in, PANEL] of
    PANEL output columns each (the last zero-padded): each panel is one contiguous stream for the kernel. Several
    weights are one product, whose output `matmul` splits again (their out shapes: `out_shapes`). `gated`: a
    gate and an up projection (`pack_gated`), one output."""

    panels: jax.Array
    out_shapes: tuple[tuple[int, ...], ...] = dataclasses.field(metadata={"static": True})
    gated: bool = dataclasses.field(default=False, metadata={"static": True})


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


def matmul(x: jax.Array, w: Packed) -> jax.Array | tuple[jax.Array, ...]:
    """x [..., in] @ the packed weight -> [..., *out], or a tuple of them for several weights packed as one."""
    sizes = [int(np.prod(shape)) for shape in w.out_shapes]
    target = GATED_TARGET if w.gated else TARGET
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:-1], sum(sizes)), x.dtype))(x, w.panels)
    lead = x.shape[:-1]
    if len(sizes) == 1:
        return out.reshape(*lead, *w.out_shapes[0])
    parts = jnp.split(out, np.cumsum(sizes)[:-1], axis=-1)
    return tuple(part.reshape(*lead, *shape) for part, shape in zip(parts, w.out_shapes, strict=True))
