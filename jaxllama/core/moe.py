"""A mixture of experts' feed-forward block (Mixtral), as a pure function over a layer's params.

Each token's router scores pick its `n_experts_per_token` experts, weighted by the softmax of those scores (the
renormalized top-k of the softmax over all experts, as Mixtral computes it). The tokens are sorted by expert and each
expert's SwiGLU block runs over its own run of them with `jax.lax.ragged_dot`: on a TPU or a GPU, a grouped product
that reads each expert's weights once and computes only the chosen (token, expert) pairs; XLA:CPU lowers it to a
masked dense product. A token's outputs are summed in a fixed order (its first choice, then its second, ...), whatever
else shares the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig

# lhs [tokens, in] by rhs [experts, out, in] (the checkpoints' (out, in) weights), tokens grouped by expert.
_BY_EXPERT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def route(router, x, k: int):
    """x [n, dim] -> (experts [n, k] int32, each token's best first; weights [n, k] float32, summing to 1)."""
    scores = jnp.einsum("nd,ed->ne", x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    top, experts = jax.lax.top_k(scores, k)
    return experts, jax.nn.softmax(top, axis=-1)


def experts_block(p, c: ModelConfig, x):
    """x [..., dim] -> [..., dim]: each token through its chosen experts' w2(silu(w1 x) * w3 x), weighted."""
    shape, k, dtype = x.shape, c.n_experts_per_token, x.dtype
    x = x.reshape(-1, shape[-1])
    experts, weights = route(p["router"], x, k)
    chosen = experts.reshape(-1)  # token i's j-th choice at i * k + j
    order = jnp.argsort(chosen, stable=True)
    sizes = jnp.bincount(chosen, length=c.n_experts).astype(jnp.int32)
    rows = x[order // k]

    def product(a, w):
        return jax.lax.ragged_dot_general(a, w.astype(dtype), sizes, _BY_EXPERT, preferred_element_type=dtype)

    hidden = jax.nn.silu(product(rows, p["gate_exps"])) * product(rows, p["up_exps"])
    out = product(hidden, p["down_exps"])[jnp.argsort(order)].reshape(-1, k, shape[-1])
    return jnp.einsum("nkd,nk->nd", out, weights.astype(dtype)).reshape(shape)
