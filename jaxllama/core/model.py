"""The decoder of every family (`jaxllama/models/`), as pure functions over a params pytree.

Every parameter is declared once, by its family (`models/family.py`: shape, logical axes, initializer, names in
checkpoints); shapes, shardings and random init derive from the declarations (`params.py`; the Flax module of
`linen.py` declares them to Flax). A family's features are the parameters its layers hold: q/k/v biases (Qwen2),
an RMSNorm over each head's queries and keys (Qwen3), applied here where a layer's params have them. Layers are
unrolled, one weight set each: XLA:CPU runs a `lax.scan` over stacked layers several times slower
(benchmarks/README.md).

The math is written in the operations of an `Ops` value (`ops.py`): XLA's by default, a backend's where the engine
chose one. Weights are stored (out, in), as PyTorch's `Linear` and every source format store them, so no converter
transposes anything.

Rotary embeddings (`rope.py`) use Meta's convention: dimension pairs (2i, 2i+1) of each head rotate together.

The KV cache is an explicit input and output: per layer a pair (k, v), values [batch, kv_heads, cache_len,
head_dim] and keys the same or transposed, as the backend's `Ops.cache_layout` says (`core/cache_layout.py`). A
call writes the keys/values of its tokens at their positions, then every query attends to the cache entries at
positions <= its own. The same code runs a whole sequence (a fresh cache as long as the sequence), a prefill (a fresh
cache as long as the bucket) and a decode step (one token per row, each row at its own position).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxllama.core import int8_kv, moe, paged_kv
from jaxllama.core.blocks import Blocks, dequantize
from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import XLA, Ops
from jaxllama.core.products import BIASES, GATE_UP, QKV
from jaxllama.core.rope import apply_rope, rope_angles
from jaxllama.core.sharding import split_activations

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer (k, v), laid out as `Ops.cache_layout` says


# ---- the math: pure functions over (sub)trees of params --------------------------------------------
# `forward` runs these directly over the params pytree (no module's `apply`: tracing through Linen's costs more per
# compile).


def rms_norm(p, x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * p["scale"].astype(jnp.float32)).astype(x.dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["positions", "rope", "rows", "pages"], meta_fields=["fresh"]
)
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a call's tokens sit, in their sequences and in the KV cache: what every layer of the call shares.

    positions [b, t]: each token's position in its sequence; rope: their `rope_angles` (computed once for all the
    layers, `Placement.of`). rows [b] (optional): the cache row of each row of tokens (the cache may then hold more
    rows than the batch; an index past them writes nothing); by default row i of the batch is row i of the cache.
    pages [b, n] (optional): the cache is a pool of pages (`core/paged_kv.py`) and row i's sequence sits in the
    pages pages[i] names. fresh (static): every row is a prompt from position 0 (positions[i] = 0..t-1), which a
    backend's kernel may attend over its own keys and values (`Ops.prompt_attention`), as the cache gives them back."""

    positions: jax.Array
    rope: tuple[jax.Array, jax.Array]
    rows: jax.Array | None = None
    pages: jax.Array | None = None
    fresh: bool = False

    @staticmethod
    def of(positions, config: ModelConfig, rows=None, pages=None, fresh: bool = False) -> Placement:
        return Placement(positions, rope_angles(positions, config), rows, pages, fresh)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["prompt", "decode"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Mixed:
    """Where a mixed step's tokens sit: prompt rows and decode rows run as one batch of tokens x [1, n + s, dim], the
    prompt rows' n = r x t tokens first (placed [r, t] as `prompt` says), then the s decode rows' (placed [s, 1] as
    `decode` says). Every product reads its weights once for both parts; each part writes and attends to the cache
    as its own call would (their rows are other slots, so neither reads what the other writes). On an accelerator
    a decode step reads the weights from memory anyway, and a prompt chunk's products ride on those reads."""

    prompt: Placement
    decode: Placement


def attention(p, c: ModelConfig, x, at: Placement | Mixed, cache_k, cache_v, ops: Ops = XLA):
    """x [b, t, dim] placed as `at` says (or a mixed step's x [1, n + s, dim]); cache_k and cache_v n rows of s
    positions, laid out as `ops.cache_layout` says (or pools of pages, with `at.pages`) -> (out, cache_k, cache_v)."""
    q, k, v = _heads(p, c, ops.project(x, p, QKV))
    if isinstance(at, Mixed):
        n, outs = at.prompt.positions.size, []
        for part, span in ((at.prompt, slice(0, n)), (at.decode, slice(n, None))):
            q_, k_, v_ = (a[0, span].reshape(*part.positions.shape, *a.shape[2:]) for a in (q, k, v))
            out, cache_k, cache_v = _attend(c, q_, k_, v_, part, cache_k, cache_v, ops)
            outs.append(out.reshape(1, -1, *out.shape[2:]))
        out = jnp.concatenate(outs, axis=1)
    else:
        out, cache_k, cache_v = _attend(c, q, k, v, at, cache_k, cache_v, ops)
    out = out.reshape(*out.shape[:2], c.n_heads, c.head_dim)  # [b, t, heads, head_dim]
    return ops.linear(out, p["wo"], in_dims=2, row_parallel=True), cache_k, cache_v


def _heads(p, c: ModelConfig, qkv):
    """The projections' outputs as heads [b, t, heads, hd] (k and v [b, t, kv, hd]), with the biases and the
    per-head norms of the layers that have them."""
    shapes = ((c.n_heads, c.head_dim), (c.n_kv_heads, c.head_dim), (c.n_kv_heads, c.head_dim))
    q, k, v = (a.reshape(*a.shape[:2], *shape) for a, shape in zip(qkv, shapes, strict=True))
    if BIASES[0] in p:
        q, k, v = (a + p[b].astype(a.dtype) for a, b in zip((q, k, v), BIASES, strict=True))
    if "q_norm" in p:
        q, k = rms_norm(p["q_norm"], q, c.norm_eps), rms_norm(p["k_norm"], k, c.norm_eps)
    return q, k, v


def _attend(c: ModelConfig, q, k, v, at: Placement, cache_k, cache_v, ops: Ops):
    """One call's attention: q [b, t, heads, hd], k and v [b, t, kv, hd] as projected, rotated here, written into
    the cache at their positions, then every query against the cache up to its own position -> (out [b, t, kv, g,
    hd], cache_k, cache_v)."""
    positions = at.positions
    q, k = apply_rope(q, at.rope, ops.rope_halves), apply_rope(k, at.rope, ops.rope_halves)
    q = q.reshape(*q.shape[:2], c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim)  # [b, t, kv, g, hd]
    # A fresh prompt's kernel attends over its keys and values as the cache will give them back (an int8 cache's
    # rounded), so that its tokens see what later tokens, and its chunks computed apart, see.
    stored = (int8_kv.as_read(k, cache_k), int8_kv.as_read(v, cache_v)) if at.fresh else (None, None)
    out = ops.prompt_attention(q, *stored) if stored[0] is not None else None

    # Write this call's keys/values at their positions (rows past the cache's end are dropped).
    if at.pages is not None:
        pages = at.pages
        cache_k, cache_v = paged_kv.write(cache_k, pages, positions, k), paged_kv.write(cache_v, pages, positions, v)
        if out is None:
            out = ops.paged_attention(q, cache_k, cache_v, positions, pages)
    else:
        rows = (jnp.arange(q.shape[0]) if at.rows is None else at.rows)[:, None]
        index = (rows, slice(None), positions)  # keys transposed: [rows, kv, head_dim, positions]
        keys_index = (rows, slice(None), slice(None), positions) if ops.cache_layout.transposed_keys else index
        cache_k, cache_v = int8_kv.write(cache_k, keys_index, k), int8_kv.write(cache_v, index, v)
        if out is None:
            out = ops.attention(q, cache_k, cache_v, positions, at.rows)
    return out, cache_k, cache_v


def mlp(p, c: ModelConfig, x, ops: Ops = XLA):
    """The feed-forward block: w2(silu(w1 x) * w3 x), or a mixture of such blocks where the layer has a router."""
    if "router" in p:
        return moe.experts_block(p, c, x, ops)
    return ops.linear(ops.gated(x, p, *GATE_UP), p["w2"], row_parallel=True)


@functools.partial(jax.jit, static_argnums=(1, 6))
def block(p, c: ModelConfig, x, at: Placement | Mixed, cache_k, cache_v, ops: Ops = XLA):
    """One decoder layer. Jitted on its own so that tracing a model traces one layer, not n_layers of
    them (the outer jit inlines it: the compiled program is the same)."""
    normed = rms_norm(p["attention_norm"], x, c.norm_eps)
    h, cache_k, cache_v = attention(p["attention"], c, normed, at, cache_k, cache_v, ops)
    x = split_activations(x + h)
    x = split_activations(x + mlp(p["mlp"], c, rms_norm(p["mlp_norm"], x, c.norm_eps), ops))
    return x, cache_k, cache_v


def activation_dtype(embedding) -> jnp.dtype:
    """The dtype a model computes in: its embedding's, float32 for an embedding stored as blocks."""
    return jnp.dtype(jnp.float32) if isinstance(embedding, Blocks) else jnp.dtype(embedding.dtype)


def embed(params, tokens):
    """The input vectors [b, t, dim] of tokens [b, t]. An embedding stored as blocks dequantizes only the rows it
    gathers (as llama.cpp does)."""
    w = params["embedding"]
    if isinstance(w, Blocks):
        rows = Blocks(jnp.take(w.quants, tokens, axis=0), jnp.take(w.scales, tokens, axis=0), w.format, w.in_shape)
        return dequantize(rows, activation_dtype(w))
    return jnp.take(w, tokens, axis=0)


def layers(layer_params: list, c: ModelConfig, x, at: Placement, cache: KVCache, ops: Ops = XLA):
    """Consecutive decoder layers (their params and caches in order) over tokens placed as `at` says:
    x -> (x, cache). The engine runs a model as a few of these programs in turn (see `engine/step.py`); `ops`: the
    backend's operations (their params prepared by `ops.prepare`)."""
    new_cache = []
    for p, (k, v) in zip(layer_params, cache, strict=True):
        x, k, v = block(p, c, x, at, k, v, ops)
        new_cache.append((k, v))
    return x, new_cache


def head(params, c: ModelConfig, x, logits_at=None, ops: Ops = XLA):
    """Final norm and output projection: x [b, t, dim] -> float32 logits [b, t, vocab], or [b, vocab] at time
    index logits_at [b] of each row. A tied model projects through its embedding, or through an `output` where
    its params have one (a backend may prepare the embedding as a product's weight there)."""
    x = rms_norm(params["norm"], x, c.norm_eps)
    if logits_at is not None:
        x = x[jnp.arange(x.shape[0]), logits_at]
    output = params.get("output", params["embedding"]) if c.tie_embeddings else params["output"]
    return ops.linear(x, output).astype(jnp.float32)


def layer_params(params, c: ModelConfig, start: int = 0, stop: int | None = None) -> list:
    """The params of layers [start, stop), in order."""
    return [params[f"layers_{i}"] for i in range(start, c.n_layers if stop is None else stop)]


def empty_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.float32, ops: Ops = XLA) -> KVCache:
    """A zero KV cache of `length` positions, laid out for `ops` (a bfloat16 cache for the CPU kernels comes back as
    its bits, uint16: `CacheLayout.zeros`)."""
    layout = ops.cache_layout
    k, v = layout.shapes(config, batch, length)
    return [(layout.zeros(k, dtype), layout.zeros(v, dtype)) for _ in range(config.n_layers)]


def forward(
    params,
    config: ModelConfig,
    tokens,
    positions,
    cache: KVCache,
    *,
    logits_at=None,
    rows=None,
    ops: Ops = XLA,
    pages=None,
):
    """The pure forward function, tokens [b, t] at positions [b, t] -> (logits float32, cache): usable inside a
    caller's own `jax.jit`. `rows` [b] (optional): the cache row each batch row reads and writes, when the cache
    holds more rows than the batch (see `Placement`). `ops`: the operations params were prepared
    for (`Ops.prepare`). `pages` [b, n] (optional): the cache is a pool of pages (`core/paged_kv.py`) and these
    are the rows' page tables. logits_at [b] (optional): logits [b, vocab] at these time indices only."""
    at = Placement.of(positions, config, rows, pages)
    x, cache = layers(layer_params(params, config), config, embed(params, tokens), at, cache, ops)
    return head(params, config, x, logits_at, ops), cache


def sequence_logits(params, config: ModelConfig, tokens: jax.Array, ops: Ops = XLA) -> jax.Array:
    """Logits [b, t, vocab] (float32) of whole sequences tokens [b, t], each starting at position 0."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = empty_cache(config, b, t, activation_dtype(params["embedding"]), ops)
    return forward(params, config, tokens, positions, cache, ops=ops)[0]
