"""The Llama decoder as Flax (Linen) modules, run as pure functions over a params pytree.

Every parameter is declared once, here, with its shape, initializer and logical axes
(`nn.with_logical_partitioning`); shapes, shardings and random init all derive from these declarations
(see `params.py`). Layers are unrolled, one weight set each: on XLA:CPU this is ~3x faster than a
`lax.scan` over stacked layers.

Weights are stored (out, in), as PyTorch's `Linear` and every source format store them, and applied as
`x @ W.T`: on XLA:CPU that is 1.2-2x faster than `x @ W` with W stored (in, out) for this model's shapes
(32x576 @ 576x576: 0.80 ms against 1.63 ms), and no converter transposes anything.

Rotary embeddings use Meta's convention: dimension pairs (2i, 2i+1) of each head rotate together
(the complex-number form of Meta's reference code). Converters bring every source to it: Meta's
weights already are; Hugging Face's q/k projections are permuted back; GGUF files already hold
Meta's layout (llama.cpp's converter undoes Hugging Face's permutation).

The KV cache is an explicit input and output: per layer a pair (k, v), keys [batch, kv_heads, head_dim,
cache_len] and values [batch, kv_heads, cache_len, head_dim] (`cache_shapes`). A call writes the
keys/values of its tokens at their positions, then every query attends to the cache entries at positions
<= its own. The same code runs a whole sequence (a fresh cache as long as the sequence), a prefill (a fresh
cache as long as the bucket) and a decode step (one token per row, each row at its own position).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.core.config import ModelConfig
from jaxllama.kernels import matmul as _matmul
from jaxllama.kernels.decode_attention import decode_attention
from jaxllama.kernels.matmul import Packed, matmul, pack, pack_gated

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer (k, v); see `cache_shapes`

# The cache's logical axes and length axis, for keys and for values. Keys are stored transposed, so that the
# q.k products of a decode step run along the cached positions: 1.6x faster attention on XLA:CPU (SmolLM2,
# 32 rows over 128 positions: 37 ms per step against 60).
CACHE_AXES = (("batch", "kv_heads", "head_dim", "cache_seq"), ("batch", "kv_heads", "cache_seq", "head_dim"))
CACHE_LENGTH_AXIS = (3, 2)


def cache_shapes(config: ModelConfig, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one layer's keys and values."""
    kv, hd = config.n_kv_heads, config.head_dim
    return (batch, kv, hd, length), (batch, kv, length, hd)


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies theta^(-2i/head_dim) for i < head_dim/2, with Llama 3.1 scaling and/or GGUF
    frequency factors if configured."""
    d = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = config.rope_scaling
    if s is not None:
        wavelen = 2 * np.pi / freqs
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * freqs / s.factor + smooth * freqs
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        freqs = np.where(wavelen < high_wavelen, freqs, np.where(wavelen > low_wavelen, freqs / s.factor, blended))
    if config.rope_freq_factors is not None:
        freqs = freqs / np.asarray(config.rope_freq_factors, dtype=np.float64)
    return freqs.astype(np.float32)


def rope_angles(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin [batch, time, 1, head_dim/2] of positions [batch, time] times the rotary frequencies. Computed
    once for all the layers of a program, and best passed in from another: XLA fuses a sine computed in the same
    program into the rotation of each layer, where it computes it for every element of every head."""
    angles = positions[:, :, None, None].astype(jnp.float32) * rope_frequencies(config)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate pairs (2i, 2i+1) of x [batch, time, heads, head_dim] by the angles `rope_angles` gives as (cos, sin)."""
    cos, sin = rope
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], dtype, init=None):
    init = init or nn.initializers.normal(stddev=0.02)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


# ---- the math: pure functions over (sub)trees of params --------------------------------------------
# `forward` runs these directly over the params pytree; the Linen modules below only declare the
# parameters and call the same functions (tracing through Linen's `apply` costs ~2x more per compile).


def linear(x: jax.Array, w: jax.Array | Packed, in_dims: int = 1):
    """x [..., *in] times w [*out, *in] (stored (out, in), `in_dims` trailing dims) -> [..., *out], as one 2-D
    product: XLA:CPU otherwise transposes 3-D attention weights on every call (32x576 @ wq: 0.51 ms
    against 1.26 ms as an einsum over (heads, head_dim, dim)). A weight packed for the CPU kernel
    (`kernels/matmul.py`) goes through it; several weights packed as one give a tuple of outputs, and a gated
    product (gate and up) gives silu(x @ gate) * (x @ up)."""
    lead = x.shape[: x.ndim - in_dims]
    if isinstance(w, Packed):
        return matmul(x.reshape(*lead, -1), w)
    n_in = int(np.prod(w.shape[w.ndim - in_dims :]))
    out = w.shape[: w.ndim - in_dims]
    y = jax.lax.dot_general(w.reshape(-1, n_in), x.reshape(-1, n_in), (((1,), (1,)), ((), ()))).T
    return y.reshape(*lead, *out)


def rms_norm(p, x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * p["scale"].astype(jnp.float32)).astype(x.dtype)


def attention(p, c: ModelConfig, x, positions, rope, cache_k, cache_v, rows=None, kernel=False):
    """x [b, t, dim], positions [b, t] and their `rope_angles`; cache_k [n, kv_heads, head_dim, s], cache_v
    [n, kv_heads, s, head_dim] -> (out, cache_k, cache_v).

    `rows` [b] (optional): the cache row of each x row (n may then exceed b; an index >= n writes nothing);
    by default row i of x is row i of the cache (n == b). `kernel`: attention through the CPU kernel
    (`kernels/decode_attention.py`, loaded by the caller; float32 weights, one device) instead of XLA: each of the b x t
    queries as one decode query against its row of the cache (XLA ran a prefill's attention at ~50 GFLOP/s, its
    softmax on one thread: 16 rows x 192 tokens over 256 positions, 35 ms a layer)."""
    q, k, v = linear(x, p["wqkv"]) if "wqkv" in p else (linear(x, p[w]) for w in ("wq", "wk", "wv"))
    q, k = apply_rope(q, rope), apply_rope(k, rope)

    # Write this call's keys/values at their positions (rows past the cache's end are dropped).
    at = (jnp.arange(x.shape[0]) if rows is None else rows)[:, None]
    cache_k = cache_k.at[at, :, :, positions].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[at, :, positions].set(v.astype(cache_v.dtype), mode="drop")
    groups = c.n_heads // c.n_kv_heads
    q = q.reshape(*q.shape[:2], c.n_kv_heads, groups, c.head_dim)  # [b, t, kv, g, hd]
    if kernel:  # the kernel reads each row's slot of the cache in place
        b, t = x.shape[:2]
        slots = jnp.repeat(jnp.arange(b) if rows is None else rows, t)
        out = decode_attention(q.reshape(b * t, *q.shape[2:]), cache_k, cache_v, slots, positions.reshape(-1))
        return _output(p, c, out.reshape(q.shape)), cache_k, cache_v
    keys, values = cache_k, cache_v
    if rows is not None:  # this batch's rows, read in place: XLA fuses the gather into the attention loops.
        # (With mode="clip", a single row becomes a slice fused with the write, and XLA copies the cache.)
        keys, values = (jnp.take(c_, rows, axis=0, mode="fill", fill_value=0) for c_ in (cache_k, cache_v))
    visible = jnp.arange(values.shape[2])[None, None, :] <= positions[:, :, None]  # [b, t, s]
    if x.shape[1] == 1:  # decode: 487 ms/step instead of 643 at batch 32, cache 512 (SmolLM2, this CPU)
        out = _decode_attention(q[:, 0], keys, values, visible[:, 0])[:, None]
    else:
        scores = jnp.einsum("btkgd,bkds->bkgts", q, keys.astype(q.dtype)).astype(jnp.float32)
        scores = jnp.where(visible[:, None, None], scores * (1.0 / np.sqrt(c.head_dim)), -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bkgts,bksd->btkgd", probs, values.astype(x.dtype))
    return _output(p, c, out), cache_k, cache_v


def _output(p, c: ModelConfig, out):
    """Attention's output projection: out [b, t, kv, g, head_dim] -> [b, t, dim]."""
    out = out.reshape(*out.shape[:2], c.n_heads, c.head_dim)  # [b, t, heads, head_dim]
    return linear(out, p["wo"], in_dims=2)


def _decode_attention(q, cache_k, cache_v, visible):
    """One query per row: q [b, kv, g, hd], cache_k [b, kv, hd, s], cache_v [b, kv, s, hd], visible [b, s] ->
    [b, kv, g, hd]. Written as products and sums, which XLA fuses into loops over the cache, instead of b * kv
    tiny matrix products."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    scores = jnp.sum(q[..., None] * cache_k[:, :, None].astype(q.dtype), axis=-2, dtype=jnp.float32)
    scores = jnp.where(visible[:, None, None, :], scores * scale, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # [b, kv, g, s]
    return jnp.sum(probs[..., None] * cache_v[:, :, None, :, :].astype(q.dtype), axis=-2)


def mlp(p, x):
    """The feed-forward block: w2(silu(w1 x) * w3 x)."""
    if "w13" in p:  # gate and up packed as one gated product (`pack_weights`): the kernel applies silu(gate) * up
        return linear(linear(x, p["w13"]), p["w2"])
    return linear(jax.nn.silu(linear(x, p["w1"])) * linear(x, p["w3"]), p["w2"])


@functools.partial(jax.jit, static_argnums=(1, 8))
def block(p, c: ModelConfig, x, positions, rope, cache_k, cache_v, rows=None, kernel=False):
    """One decoder layer. Jitted on its own so that tracing a model traces one layer, not n_layers of
    them (the outer jit inlines it: the compiled program is the same)."""
    h, cache_k, cache_v = attention(
        p["attention"], c, rms_norm(p["attention_norm"], x, c.norm_eps), positions, rope, cache_k, cache_v, rows, kernel
    )
    x = x + h
    x = x + mlp(p["mlp"], rms_norm(p["mlp_norm"], x, c.norm_eps))
    return x, cache_k, cache_v


def embed(params, tokens):
    """The input vectors [b, t, dim] of tokens [b, t]."""
    return jnp.take(params["embedding"], tokens, axis=0)


def layers(layer_params: list, c: ModelConfig, x, positions, cache: KVCache, rows=None, kernel=False, rope=None):
    """Consecutive decoder layers (their params and caches in order): x -> (x, cache). The engine runs a
    model as a few of these programs in turn (see `engine/step.py`); `kernel` as in `attention`; `rope`: the
    positions' `rope_angles`, if computed already."""
    new_cache, rope = [], rope_angles(positions, c) if rope is None else rope
    for p, (k, v) in zip(layer_params, cache, strict=True):
        x, k, v = block(p, c, x, positions, rope, k, v, rows, kernel)
        new_cache.append((k, v))
    return x, new_cache


def head(params, c: ModelConfig, x, logits_at=None):
    """Final norm and output projection: x [b, t, dim] -> float32 logits [b, t, vocab], or [b, vocab] at time
    index logits_at [b] of each row. A tied model projects through its embedding, or through an `output`
    (the embedding packed by `pack_weights`) where its params have one."""
    x = rms_norm(params["norm"], x, c.norm_eps)
    if logits_at is not None:
        x = x[jnp.arange(x.shape[0]), logits_at]
    output = params.get("output", params["embedding"]) if c.tie_embeddings else params["output"]
    return linear(x, output).astype(jnp.float32)


# Every product's weight, by its name in the params tree, and the trailing dims it contracts (`linear`'s in_dims);
# the weights that multiply the same input, packed as one product (`wqkv` then takes their place), and the MLP's
# gate and up projections, packed as one gated product (`w13`).
PRODUCT_IN_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w1": 1, "w2": 1, "w3": 1, "output": 1}
FUSED_PRODUCTS = {"wqkv": ("wq", "wk", "wv")}
GATED_PRODUCTS = {"w13": ("w1", "w3")}


def pack_weights(params, c: ModelConfig, quantize: str | None = None):
    """params (the whole tree, or the layers' or outer part of it) with every product's weight packed for the CPU
    matmul kernel (`kernels/matmul.py`), which `linear` then calls: the weights of one input fused as one product,
    the MLP's gate and up as one gated product, a tied model's embedding also packed as its `output`. Float32, on
    one device; `quantize` (one of `matmul.QUANTIZATIONS`): every packed weight then quantized to int8 blocks
    (`matmul.quantize`, Q8_0)."""

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        node = {k: walk(v) for k, v in node.items()}
        for fused, names in FUSED_PRODUCTS.items():
            if all(name in node for name in names):
                node[fused] = pack(*(node.pop(name) for name in names), in_dims=PRODUCT_IN_DIMS[names[0]])
        for gated, names in GATED_PRODUCTS.items():
            if all(name in node for name in names):
                node[gated] = pack_gated(*(node.pop(name) for name in names))
        for name, in_dims in PRODUCT_IN_DIMS.items():
            if isinstance(node.get(name), jax.Array):
                node[name] = pack(node[name], in_dims=in_dims)
        return node

    packed = walk(params)
    if isinstance(packed, dict) and c.tie_embeddings and "embedding" in packed:
        packed["output"] = pack(packed["embedding"])
    if quantize:
        to_int8 = lambda w: _matmul.quantize(w, quantize) if _is_packed(w) else w
        packed = jax.tree.map(to_int8, packed, is_leaf=_is_packed)
    return packed


def _is_packed(node) -> bool:
    return isinstance(node, Packed)


def layer_params(params, c: ModelConfig, start: int = 0, stop: int | None = None) -> list:
    """The params of layers [start, stop), in order."""
    return [params[f"layers_{i}"] for i in range(start, c.n_layers if stop is None else stop)]


def llama(params, c: ModelConfig, tokens, positions, cache: KVCache, logits_at=None, rows=None):
    """tokens [b, t], positions [b, t], cache -> (logits float32, cache); see `Llama`."""
    x, cache = layers(layer_params(params, c), c, embed(params, tokens), positions, cache, rows)
    return head(params, c, x, logits_at), cache


# ---- the declarations: every parameter's shape, initializer and logical axes ------------------------
# Each module, called, declares its parameters and returns them as a dict shaped like its part of the
# params tree; `Llama` hands the whole tree to `llama`. Initialization (params.py) traces `Llama`.


class RMSNorm(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        return {"scale": _param(self, "scale", (self.config.dim,), ("norm",), self.dtype, nn.initializers.ones)}


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        c = self.config
        return {
            "wq": _param(self, "wq", (c.n_heads, c.head_dim, c.dim), ("heads", "head_dim", "embed"), self.dtype),
            "wk": _param(self, "wk", (c.n_kv_heads, c.head_dim, c.dim), ("kv_heads", "head_dim", "embed"), self.dtype),
            "wv": _param(self, "wv", (c.n_kv_heads, c.head_dim, c.dim), ("kv_heads", "head_dim", "embed"), self.dtype),
            "wo": _param(self, "wo", (c.dim, c.n_heads, c.head_dim), ("embed", "heads", "head_dim"), self.dtype),
        }


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        c = self.config
        return {
            "w1": _param(self, "w1", (c.ffn_dim, c.dim), ("mlp", "embed"), self.dtype),  # gate
            "w3": _param(self, "w3", (c.ffn_dim, c.dim), ("mlp", "embed"), self.dtype),  # up
            "w2": _param(self, "w2", (c.dim, c.ffn_dim), ("embed", "mlp"), self.dtype),  # down
        }


class Block(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        c, dtype = self.config, self.dtype
        return {
            "attention_norm": RMSNorm(c, dtype, name="attention_norm")(),
            "attention": Attention(c, dtype, name="attention")(),
            "mlp_norm": RMSNorm(c, dtype, name="mlp_norm")(),
            "mlp": MLP(c, dtype, name="mlp")(),
        }


class Llama(nn.Module):
    """tokens [b, t], positions [b, t], cache -> (logits, cache).

    `logits_at` [b] (optional): compute logits only at that time index of each row -> logits [b, vocab];
    otherwise logits for every position -> [b, t, vocab]. Logits are float32.
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache, logits_at=None):
        c, dtype = self.config, self.dtype
        params = {"embedding": _param(self, "embedding", (c.vocab_size, c.dim), ("vocab", "embed"), dtype)}
        params |= {f"layers_{i}": Block(c, dtype, name=f"layers_{i}")() for i in range(c.n_layers)}
        params["norm"] = RMSNorm(c, dtype, name="norm")()
        if not c.tie_embeddings:
            params["output"] = _param(self, "output", (c.vocab_size, c.dim), ("vocab", "embed"), dtype)
        return llama(params, c, tokens, positions, cache, logits_at)


def empty_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> KVCache:
    """A zero KV cache of `length` positions."""
    k, v = cache_shapes(config, batch, length)
    return [(jnp.zeros(k, dtype), jnp.zeros(v, dtype)) for _ in range(config.n_layers)]


def forward(params, config: ModelConfig, tokens, positions, cache: KVCache, logits_at=None, rows=None):
    """The pure forward function: usable inside a caller's own `jax.jit`. `rows` [b] (optional): the cache
    row each batch row reads and writes, when the cache holds more rows than the batch (see `attention`)."""
    return llama(params, config, tokens, positions, cache, logits_at, rows)


def sequence_logits(params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits [b, t, vocab] (float32) of whole sequences tokens [b, t], each starting at position 0."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = empty_cache(config, b, t, jax.tree.leaves(params)[0].dtype)
    return forward(params, config, tokens, positions, cache)[0]
