"""Matrix products against weights packed once into the layout of the CPU kernel `matmul.cc`, called from jitted code
through XLA's FFI once `library.load` has built and registered it.

`pack` turns a weight stored (out, in) into a `Packed` pytree; code that multiplies by a weight checks for one
(`core.model.linear`), so that a params tree with packed weights runs through the kernel without a switch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxllama_matmul"
PANEL = 16  # output columns per panel (matmul.cc's kPanel)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """A weight [*out, *in] as panels [ceil(out / PANEL), in, PANEL] of PANEL output columns each (the last
    zero-padded): each panel is one contiguous stream for the kernel."""

    panels: jax.Array
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def dtype(self):
        return self.panels.dtype


@jax.jit(static_argnames="in_dims")
def pack(w: jax.Array, in_dims: int = 1) -> Packed:
    """w [*out, *in] (stored (out, in), `in_dims` trailing dims) -> Packed."""
    n_in = int(np.prod(w.shape[w.ndim - in_dims :]))
    out_shape = tuple(w.shape[: w.ndim - in_dims])
    w = w.reshape(-1, n_in)
    panels = -(-w.shape[0] // PANEL)
    w = jnp.pad(w, ((0, panels * PANEL - w.shape[0]), (0, 0)))
    return Packed(w.reshape(panels, PANEL, n_in).transpose(0, 2, 1), out_shape)


def matmul(x: jax.Array, w: Packed) -> jax.Array:
    """x [..., in] @ the packed weight -> [..., *out], float32."""
    n_out = int(np.prod(w.out_shape))
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*x.shape[:-1], n_out), x.dtype))(x, w.panels)
    return out.reshape(*x.shape[:-1], *w.out_shape)
