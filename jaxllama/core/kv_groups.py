"""KV heads repeated to fill the mesh's `model` axis, so that no device holds (or reads) every KV head's cache.

With fewer KV heads than devices along `model` (Llama 3's 8 KV heads on 16 chips), the heads cannot be split one
per device, and the KV cache and the wk/wv weights would be replicated on every device: each decode step would read
the whole cache on every chip and all-gather each layer's keys and values. Instead each KV head is repeated r times
(r = model / n_kv_heads), in place, so that the model runs with n_kv_heads * r heads, one group per device, as
jax-llm-examples does. The math is the same: query head h reads KV head h // (n_heads / n_kv_heads); after the
repetition it reads head h // (n_heads / (n_kv_heads * r)), the r-th copy of the same head. Each device then holds
1/r of the cache it held (the cache counts each head r times in all, once per device of its group).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxllama.core.blocks import Blocks
from jaxllama.core.config import ModelConfig

REPEATED = ("wk", "wv")  # the weights whose first axis is the KV heads


def repeats(config: ModelConfig, model_axis: int) -> int:
    """How many times each KV head is repeated on a `model` axis of this size: model / n_kv_heads where the model
    axis is a multiple of the KV heads (and divides the query heads), else 1."""
    kv = config.n_kv_heads
    if model_axis > kv and model_axis % kv == 0 and config.n_heads % model_axis == 0:
        return model_axis // kv
    return 1


def repeated_config(config: ModelConfig, r: int) -> ModelConfig:
    """The config the model runs with when each KV head is repeated r times."""
    return config if r == 1 else dataclasses.replace(config, n_kv_heads=config.n_kv_heads * r)


def repeat_heads(params: dict, config: ModelConfig, r: int) -> dict:
    """`params` (of `config`) with each layer's wk and wv heads repeated r times in place (head i becomes heads
    i*r .. i*r + r - 1): the params of `repeated_config(config, r)`."""
    if r == 1:
        return params
    return {k: repeat_layer(v, r=r) if k.startswith("layers_") else v for k, v in params.items()}


def repeat_layer(layer: dict, *, r: int) -> dict:
    """One layer's params with its wk and wv heads repeated r times."""

    def repeat(w):
        if isinstance(w, Blocks):
            return dataclasses.replace(
                w, quants=jnp.repeat(w.quants, r, axis=0), scales=jnp.repeat(w.scales, r, axis=0)
            )
        return jnp.repeat(w, r, axis=0)

    attention = {k: repeat(w) if k in REPEATED else w for k, w in layer["attention"].items()}
    return {**layer, "attention": attention}


def repeat_on_mesh(params: dict, config: ModelConfig, r: int, layer_shardings) -> dict:
    """`repeat_heads` on the params' devices, a layer at a time (one layer's repeated wk/wv beside its originals,
    never the model's weights twice), each layer's outputs sharded as `layer_shardings` (a layer's param shardings
    in the repeated config) say: one compiled program for every layer."""
    if r == 1:
        return params
    fn = jax.jit(functools.partial(repeat_layer, r=r), out_shardings=layer_shardings)
    return {k: fn(v) if k.startswith("layers_") else v for k, v in params.items()}
