"""A mixture of experts' feed-forward block (Mixtral), as a pure function over a layer's params.

Each token's router scores pick its `n_experts_per_token` experts, weighted by the softmax of those scores (the
renormalized top-k of the softmax over all experts, as Mixtral computes it). The tokens are sorted by expert and each
expert's SwiGLU block runs over its own run of them (`Ops.grouped`: XLA's `ragged_dot`, which XLA:CPU and the TPU
compiler lower to a masked product of every expert over every row; on a TPU the megablox kernel, which reads each
expert's weights once and computes only the chosen (token, expert) pairs). A token's outputs are summed in a fixed
order (its first choice, then its second, ...), whatever else shares the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import XLA, Ops


def route(router, x, k: int):
    """x [n, dim] -> (experts [n, k] int32, each token's best first; weights [n, k] float32, summing to 1)."""
    scores = jnp.einsum("nd,ed->ne", x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    top, experts = jax.lax.top_k(scores, k)
    return experts, jax.nn.softmax(top, axis=-1)


def experts_block(p, c: ModelConfig, x, ops: Ops = XLA):
    """x [..., dim] -> [..., dim]: each token through its chosen experts' w2(silu(w1 x) * w3 x), weighted; the
    products grouped by expert by `ops.grouped`."""
    shape, k, dtype = x.shape, c.n_experts_per_token, x.dtype
    x = x.reshape(-1, shape[-1])
    experts, weights = route(p["router"], x, k)
    chosen = experts.reshape(-1)  # token i's j-th choice at i * k + j
    order = jnp.argsort(chosen, stable=True)
    sizes = jnp.bincount(chosen, length=c.n_experts).astype(jnp.int32)
    rows = x[order // k]

    gate, up = (ops.grouped(rows, p[name].astype(dtype), sizes) for name in ("gate_exps", "up_exps"))
    out = ops.grouped(jax.nn.silu(gate) * up, p["down_exps"].astype(dtype), sizes, row_parallel=True)
    out = out[jnp.argsort(order)].reshape(-1, k, shape[-1])
    return jnp.einsum("nkd,nk->nd", out, weights.astype(dtype)).reshape(shape)
