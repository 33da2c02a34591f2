"""The Llama decoder as Flax (Linen) modules, run as pure functions over a params pytree.

Every parameter is declared once, here, with its shape, initializer and logical axes
(`nn.with_logical_partitioning`); shapes, shardings and random init all derive from these declarations
(see `params.py`). Layers are unrolled, one weight set each: on XLA:CPU this is ~3x faster than a
`lax.scan` over stacked layers.

Rotary embeddings use Meta's convention: dimension pairs (2i, 2i+1) of each head rotate together
(the complex-number form of Meta's reference code). Converters bring every source to it: Meta's
weights already are; Hugging Face's q/k projections are permuted back; GGUF files already hold
Meta's layout (llama.cpp's converter undoes Hugging Face's permutation).

The KV cache is an explicit input and output: per layer a pair (k, v) of [batch, kv_heads, cache_len,
head_dim]. A call writes the keys/values of its tokens at their positions, then every query attends to
the cache entries at positions <= its own. The same code runs a whole sequence (a fresh cache as long
as the sequence), a prefill (a fresh cache as long as the bucket) and a decode step (one token per row,
each row at its own position).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.core.config import ModelConfig

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer (k, v): [batch, kv_heads, cache_len, head_dim]


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


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """Rotate pairs (2i, 2i+1) of x [batch, time, heads, head_dim] by positions [batch, time] * freqs."""
    angles = positions[:, :, None, None].astype(jnp.float32) * freqs  # [b, t, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], dtype, init=None):
    init = init or nn.initializers.normal(stddev=0.02)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(self, "scale", (self.config.dim,), ("norm",), self.dtype, nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.norm_eps)
        return (normed * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, cache_k, cache_v):
        """x [b, t, dim], positions [b, t]; cache_k/v [b, kv_heads, s, head_dim] -> (out, cache_k, cache_v)."""
        c = self.config
        wq = _param(self, "wq", (c.dim, c.n_heads, c.head_dim), ("embed", "heads", "head_dim"), self.dtype)
        wk = _param(self, "wk", (c.dim, c.n_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), self.dtype)
        wv = _param(self, "wv", (c.dim, c.n_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), self.dtype)
        wo = _param(self, "wo", (c.n_heads, c.head_dim, c.dim), ("heads", "head_dim", "embed"), self.dtype)
        freqs = rope_frequencies(c)
        q = apply_rope(jnp.einsum("btd,dhk->bthk", x, wq), positions, freqs)
        k = apply_rope(jnp.einsum("btd,dhk->bthk", x, wk), positions, freqs)
        v = jnp.einsum("btd,dhk->bthk", x, wv)

        # Write this call's keys/values at their positions (rows past the cache's end are dropped).
        rows = jnp.arange(x.shape[0])[:, None]
        cache_k = cache_k.at[rows, :, positions].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[rows, :, positions].set(v.astype(cache_v.dtype), mode="drop")

        groups = c.n_heads // c.n_kv_heads
        q = q.reshape(*q.shape[:2], c.n_kv_heads, groups, c.head_dim)  # [b, t, kv, g, hd]
        scores = jnp.einsum("btkgd,bksd->bkgts", q, cache_k.astype(q.dtype)).astype(jnp.float32)
        scores = scores * (1.0 / np.sqrt(c.head_dim))
        visible = jnp.arange(cache_k.shape[2])[None, None, :] <= positions[:, :, None]  # [b, t, s]
        scores = jnp.where(visible[:, None, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bkgts,bksd->btkgd", probs, cache_v.astype(x.dtype))
        out = out.reshape(*out.shape[:2], c.n_heads, c.head_dim)
        return jnp.einsum("bthk,hkd->btd", out, wo), cache_k, cache_v


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.config
        w1 = _param(self, "w1", (c.dim, c.ffn_dim), ("embed", "mlp"), self.dtype)  # gate
        w3 = _param(self, "w3", (c.dim, c.ffn_dim), ("embed", "mlp"), self.dtype)  # up
        w2 = _param(self, "w2", (c.ffn_dim, c.dim), ("mlp", "embed"), self.dtype)  # down
        return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


class Block(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, cache_k, cache_v):
        h, cache_k, cache_v = Attention(self.config, self.dtype, name="attention")(
            RMSNorm(self.config, self.dtype, name="attention_norm")(x), positions, cache_k, cache_v
        )
        x = x + h
        x = x + MLP(self.config, self.dtype, name="mlp")(RMSNorm(self.config, self.dtype, name="mlp_norm")(x))
        return x, cache_k, cache_v


class Llama(nn.Module):
    """tokens [b, t], positions [b, t], cache -> (logits, cache).

    `logits_at` [b] (optional): compute logits only at that time index of each row -> logits [b, vocab];
    otherwise logits for every position -> [b, t, vocab]. Logits are float32.
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache, logits_at=None):
        c = self.config
        embedding = _param(self, "embedding", (c.vocab_size, c.dim), ("vocab", "embed"), self.dtype)
        x = jnp.take(embedding, tokens, axis=0)
        new_cache = []
        for i in range(c.n_layers):
            x, k, v = Block(c, self.dtype, name=f"layers_{i}")(x, positions, *cache[i])
            new_cache.append((k, v))
        x = RMSNorm(c, self.dtype, name="norm")(x)
        if logits_at is not None:
            x = x[jnp.arange(x.shape[0]), logits_at]
        if c.tie_embeddings:
            logits = x @ embedding.T
        else:
            logits = x @ _param(self, "output", (c.dim, c.vocab_size), ("embed", "vocab"), self.dtype)
        return logits.astype(jnp.float32), new_cache


def empty_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> KVCache:
    """A zero KV cache: per layer (k, v) of [batch, kv_heads, length, head_dim]."""
    shape = (batch, config.n_kv_heads, length, config.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.n_layers)]


def forward(params, config: ModelConfig, tokens, positions, cache: KVCache, logits_at=None):
    """The pure forward function: usable inside a caller's own `jax.jit`."""
    dtype = jax.tree.leaves(params)[0].dtype
    return Llama(config, dtype).apply({"params": params}, tokens, positions, cache, logits_at)


def sequence_logits(params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits [b, t, vocab] (float32) of whole sequences tokens [b, t], each starting at position 0."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = empty_cache(config, b, t, jax.tree.leaves(params)[0].dtype)
    return forward(params, config, tokens, positions, cache)[0]
