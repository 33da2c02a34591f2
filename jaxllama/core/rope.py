"""Rotary position embeddings: each head's dims rotate in pairs by angles that grow with the position.

Meta's convention: dimension pairs (2i, 2i+1) of each head rotate together (the complex-number form of Meta's
reference code). Converters bring every source to it: Meta's weights already are; Hugging Face's q/k projections are
permuted back; GGUF files already hold Meta's layout (llama.cpp's converter undoes Hugging Face's permutation). A
backend may reorder each head's dims so that pairs are halves instead (`rope_halves_order`, `Ops.rope_halves`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.core.config import ModelConfig


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


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array], halves: bool = False) -> jax.Array:
    """Rotate pairs (2i, 2i+1) of x [batch, time, heads, head_dim] by the angles `rope_angles` gives as (cos, sin);
    with `halves`, pairs (i, i + head_dim/2): the same rotation of heads whose dims are in `rope_halves_order`."""
    cos, sin = rope
    x32 = x.astype(jnp.float32)
    if halves:
        first, second = jnp.split(x32, 2, axis=-1)
        return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1).astype(x.dtype)
    pairs = x32.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def rope_halves_order(head_dim: int) -> np.ndarray:
    """A head's dims reordered so that each rotary pair (2i, 2i+1) sits at (i, i + head_dim/2): the even dims, then
    the odd ones. Applied to the rows of wq and wk alike (`Ops.rope_halves`), it reorders each query's and key's dims
    the same way, so every score q.k, and so the model's outputs, stay what they were; a TPU rotates halves in
    whole vector registers, where pairs put a dimension of 2 last, padded to 128 lanes."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
