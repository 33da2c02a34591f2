"""The CPU kernels as the model's operations: `CpuOps` runs products on packed (or int8) weights, attention over the
KV cache and greedy row statistics through the kernels of this package, and XLA's code for the rest.

`prepare` packs every product's weight once (`matmul.pack`): the weights that multiply the same input as one product
(stored under their names joined by "+", e.g. "wq+wk+wv"), the feed-forward gate and up projections as one gated
product, a tied model's embedding also as its `output`; with `quantize`, every packed weight then becomes int8 blocks
(`matmul.quantize`). The kernels need the library loaded (`library.load`): `jaxllama.backends.choose` does that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxllama.backends.cpu import library, matmul
from jaxllama.backends.cpu.decode_attention import decode_attention
from jaxllama.backends.cpu.row_stats import row_stats
from jaxllama.core.model import GATE_UP, PRODUCT_IN_DIMS, QKV
from jaxllama.core.ops import NO_YNNPACK, Ops


def fused_key(names) -> str:
    """The key a group of weights packed as one product is stored under, in place of theirs."""
    return "+".join(names)


# The products each group's weights become, by the key `prepare` stores them under.
FUSED = {fused_key(QKV): QKV}
GATED = {fused_key(GATE_UP): GATE_UP}


@dataclasses.dataclass(frozen=True)
class CpuOps(Ops):
    """The CPU kernels' operations, on weights in float32 or quantized (`quantize`: one of matmul.QUANTIZATIONS)."""

    quantize: str | None = None

    def __post_init__(self):
        matmul.check_quantization(self.quantize)

    def prepare(self, params, config) -> dict:
        """Weights already packed stay as they are (params prepared by another CpuOps may be prepared again)."""
        packed = _pack(params)
        if isinstance(packed, dict) and config.tie_embeddings and "embedding" in packed and "output" not in packed:
            packed["output"] = matmul.pack(packed["embedding"])
        if self.quantize:
            unquantized = lambda w: isinstance(w, matmul.Packed) and w.scales is None
            to_int8 = lambda w: matmul.quantize(w, self.quantize) if unquantized(w) else w
            packed = jax.tree.map(to_int8, packed, is_leaf=lambda w: isinstance(w, matmul.Packed))
        return packed

    def weight_bytes(self, config, dtype) -> int:
        """Every product's weight packed (float32, or 1.125 bytes a weight: int8 and a float32 scale per 32), the
        embedding kept in float32 for its lookups, the norms as they are."""
        per_weight = 4 if self.quantize is None else 1 + 4 / matmul.Q_BLOCK
        embedding = config.vocab_size * config.dim
        norms = (2 * config.n_layers + 1) * config.dim
        products = config.n_params - norms - embedding + (embedding if config.tie_embeddings else 0)
        return int(products * per_weight) + 4 * (embedding + norms)

    def linear(self, x, w, in_dims: int = 1):
        if isinstance(w, matmul.Packed):
            return matmul.matmul(x.reshape(*x.shape[: x.ndim - in_dims], -1), w)
        return super().linear(x, w, in_dims)

    def project(self, x, p: dict, names: Sequence[str], in_dims: int = 1):
        fused = fused_key(names)
        if fused in p:
            return matmul.matmul(x.reshape(*x.shape[: x.ndim - in_dims], -1), p[fused])
        return super().project(x, p, names, in_dims)

    def gated(self, x, p: dict, gate: str, up: str):
        fused = fused_key((gate, up))
        if fused in p:  # the kernel applies silu(gate) * up as it stores the product
            return matmul.matmul(x, p[fused])
        return super().gated(x, p, gate, up)

    def attention(self, q, cache_k, cache_v, positions, rows=None):
        """Each of the b x t queries as one decode query against its row of the cache, read in place (the kernel
        runs a prefill's attention too: XLA's runs its softmax on one thread)."""
        b, t = q.shape[:2]
        slots = jnp.repeat(jnp.arange(b) if rows is None else rows, t)
        out = decode_attention(q.reshape(b * t, *q.shape[2:]), cache_k, cache_v, slots, positions.reshape(-1))
        return out.reshape(q.shape)

    def greedy(self, logits):
        tokens, top, logz = row_stats(logits)  # one pass over the logits, on every thread
        return tokens, top - logz

    def compiler_options(self, program: str) -> dict:
        return NO_YNNPACK  # no product is left for XLA's YNNPACK kernels

    @property
    def custom_calls(self) -> tuple[str, ...]:
        return tuple(library.TARGETS)


def _pack(node):
    """A params (sub)tree with every product's weight packed, each group of products of one input as one product."""
    if isinstance(node, list):
        return [_pack(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _pack(v) for k, v in node.items()}
    for fused, names in FUSED.items():
        if all(name in node for name in names):
            node[fused] = matmul.pack(*(node.pop(name) for name in names), in_dims=PRODUCT_IN_DIMS[names[0]])
    for gated, names in GATED.items():
        if all(name in node for name in names):
            node[gated] = matmul.pack_gated(*(node.pop(name) for name in names))
    for name, in_dims in PRODUCT_IN_DIMS.items():
        if isinstance(node.get(name), jax.Array):
            node[name] = matmul.pack(node[name], in_dims=in_dims)
    return node
