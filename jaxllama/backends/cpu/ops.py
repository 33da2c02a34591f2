"""The CPU kernels as the model's operations: `CpuOps` runs products on packed (or int8) weights, attention over the
KV cache and greedy row statistics through the kernels of this package, and XLA's code for the rest.

`prepare` packs every product's weight once, as stored (`matmul.pack`: float32, bfloat16, Q8_0 or Q4_0 `Blocks`):
the weights that multiply the same input as one product where they are stored alike (under their names joined by
"+", e.g. "wq+wk+wv"), the feed-forward gate and up projections as one gated product, a tied model's embedding also
as its `output`; with `quantize`, every float weight then becomes blocks (`matmul.quantize`), while weights stored
as blocks are read as stored. The kernels need the library loaded (`library.load`): `jaxllama.backends.choose` does
that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.backends.cpu import library, matmul
from jaxllama.backends.cpu.decode_attention import decode_attention
from jaxllama.backends.cpu.row_stats import row_stats
from jaxllama.core.blocks import BLOCK, GGUF_BLOCK_BYTES, Blocks
from jaxllama.core.cache_layout import TRANSPOSED_KEYS, CacheLayout
from jaxllama.core.ops import NO_YNNPACK, Ops
from jaxllama.core.params import param_layout
from jaxllama.core.products import GATE_UP, PRODUCT_IN_DIMS, QKV


def fused_key(names) -> str:
    """The key a group of weights packed as one product is stored under, in place of theirs."""
    return "+".join(names)


# The products each group's weights become, by the key `prepare` stores them under.
FUSED = {fused_key(QKV): QKV}
GATED = {fused_key(GATE_UP): GATE_UP}


@dataclasses.dataclass(frozen=True)
class CpuOps(Ops):
    """The CPU kernels' operations, on weights as stored or, where stored as floats, quantized at load (`quantize`:
    one of matmul.QUANTIZATIONS). Q8_0 blocks are read in the layout of `quantize` "w8a8", else of "q8_0"."""

    quantize: str | None = None
    prepared_on_host: ClassVar[bool] = True
    # The attention kernel reads keys transposed: its q.k loops run along the cached positions in order.
    cache_layout: ClassVar[CacheLayout] = TRANSPOSED_KEYS
    # The attention kernel reads each query's slot in place and computes a prompt's consecutive tokens together.
    packed_prefill: ClassVar[bool] = True

    def __post_init__(self):
        matmul.check_quantization(self.quantize)

    def prepare(self, params, config) -> dict:
        """Weights already packed stay as they are (params prepared by another CpuOps may be prepared again)."""
        layout = "w8a8" if self.quantize == "w8a8" else "q8_0"
        packed = _pack(params, layout)
        if isinstance(packed, dict) and config.tie_embeddings and "embedding" in packed and "output" not in packed:
            packed["output"] = matmul.pack(packed["embedding"], layout=layout)
        if self.quantize:
            unquantized = lambda w: isinstance(w, matmul.Packed) and w.scales is None
            to_blocks = lambda w: matmul.quantize(w, self.quantize) if unquantized(w) else w
            packed = jax.tree.map(to_blocks, packed, is_leaf=lambda w: isinstance(w, matmul.Packed))
        return packed

    def prepare_abstract(self, params, config) -> dict:
        """What `prepare` makes of abstract params: the packing traced for its shapes alone, so that programs
        compiled without weights (`engine/aot.py`, a job's prediction) read the panels the kernels read."""
        return jax.eval_shape(lambda p: self.prepare(p, config), params)

    def weight_bytes(self, config, dtype) -> int:
        """The bytes of a model's weights once prepared: every product's weight packed (`PACKED_BYTES`; a tied
        embedding also as the output's), the rest (the embedding, for its lookups, and the norms) as stored. A
        weight is stored as the config's `stored_as` names it (a dtype or a Blocks format), else as `dtype` (a
        dtype, or a Blocks format: the products' form; the norms then in float32)."""
        named = dict(getattr(config, "stored_as", ()))
        default = dtype if dtype in GGUF_BLOCK_BYTES else jnp.dtype(dtype).name
        total = 0.0
        for name, (shape, _) in param_layout(config).items():
            n = int(np.prod(shape))
            stored = named.get(name, default)
            leaf = name.rsplit("/", 1)[-1]
            if leaf != "embedding" and leaf not in PRODUCT_IN_DIMS and stored in GGUF_BLOCK_BYTES:
                stored = "float32"  # a norm of a model whose weights are blocks
            if leaf in PRODUCT_IN_DIMS:
                total += n * PACKED_BYTES[self._packed_form(stored)]
                continue
            total += n * (
                GGUF_BLOCK_BYTES[stored] / BLOCK if stored in GGUF_BLOCK_BYTES else jnp.dtype(stored).itemsize
            )
            if leaf == "embedding" and config.tie_embeddings:
                total += n * PACKED_BYTES[self._packed_form(stored)]
        return int(total)

    def _packed_form(self, stored: str) -> str:
        """The form `prepare` packs a weight stored as `stored` in (a key of PACKED_BYTES)."""
        if stored in GGUF_BLOCK_BYTES:
            return stored
        if self.quantize:
            return self.quantize
        return stored if stored in PACKED_BYTES else "float32"

    def linear(self, x, w, in_dims: int = 1, row_parallel: bool = False):
        if isinstance(w, matmul.Packed):  # one device: no model axis splits it
            return matmul.matmul(x.reshape(*x.shape[: x.ndim - in_dims], -1), w)
        return super().linear(x, w, in_dims, row_parallel)

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

    def cache_dtype(self, activations):
        """float16 for float32 activations, as llama.cpp's default cache: the kernel converts keys and values to
        float32 as it reads them, so attention reads half the bytes and the cache takes half the memory, for a
        distribution that moves by a mean KL of ~1e-6 on the default model (`benchmarks/kv_cache_quality.py`).
        `kv_cache_dtype="float32"` keeps it exact."""
        return jnp.float16 if jnp.dtype(activations) == jnp.float32 else activations

    def attention(self, q, cache_k, cache_v, positions, rows=None):
        """Each of the b x t queries as one decode query against its row of the cache, read in place (the kernel
        runs a prefill's attention too: XLA's runs its softmax on one thread)."""
        b, t = q.shape[:2]
        slots = jnp.repeat(jnp.arange(b) if rows is None else rows, t)
        queries = q.reshape(b * t, *q.shape[2:]).astype(jnp.float32)  # the kernel computes in float32
        out = decode_attention(queries, cache_k, cache_v, slots, positions.reshape(-1))
        return out.reshape(q.shape).astype(q.dtype)

    def greedy(self, logits):
        tokens, top, logz = row_stats(logits.astype(jnp.float32))  # one pass over the logits, on every thread
        return tokens, top - logz

    def logsumexp(self, logits):
        flat = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
        return row_stats(flat)[2].reshape(logits.shape[:-1])  # a row's sum whatever rows share the call

    def compiler_options(self, program: str, device) -> dict:
        return NO_YNNPACK  # no product is left for XLA's YNNPACK kernels

    @property
    def custom_calls(self) -> tuple[str, ...]:
        return tuple(library.TARGETS)


# Bytes a weight of each packed form: float32, bfloat16, int8 + a float32 scale per 32 (Q8_0's layouts), 4 bits + a
# float16 scale per 32 (Q4_0).
PACKED_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "q8_0": 1 + 4 / BLOCK,
    "w8a8": 1 + 4 / BLOCK,
    "q4_0": 0.5 + 2 / BLOCK,
}


def _unpacked(w) -> bool:
    return isinstance(w, (jax.Array, Blocks))


def _pack(node, layout: str):
    """A params (sub)tree with every product's weight packed, each group of products of one input, stored alike, as
    one product (Q8_0 blocks in `layout`)."""
    if isinstance(node, list):
        return [_pack(x, layout) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _pack(v, layout) for k, v in node.items()}
    alike = lambda names: all(_unpacked(node.get(n)) for n in names) and len({matmul.kind(node[n]) for n in names}) == 1
    for fused, names in FUSED.items():
        if alike(names):
            weights = (node.pop(name) for name in names)
            node[fused] = matmul.pack(*weights, in_dims=PRODUCT_IN_DIMS[names[0]], layout=layout)
    for gated, names in GATED.items():
        if alike(names):
            node[gated] = matmul.pack_gated(*(node.pop(name) for name in names), layout=layout)
    for name, in_dims in PRODUCT_IN_DIMS.items():
        if _unpacked(node.get(name)):
            node[name] = matmul.pack(node[name], in_dims=in_dims, layout=layout)
    return node
