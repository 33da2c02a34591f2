"""Rotary embeddings (`core/rope.py`): a head whose dims are reordered to put each rotary pair in halves rotates as
the pairs do, and a model whose wq and wk are reordered so (`Ops.rope_halves`, the accelerators') gives the same
logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.core import model
from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import Ops
from jaxllama.core.params import init_params
from jaxllama.core.rope import apply_rope, rope_angles, rope_halves_order


def test_halves_of_reordered_dims_rotate_as_the_pairs_do():
    config = ModelConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=32, max_seq_len=64)
    x = jax.random.normal(jax.random.key(0), (2, 5, 4, config.head_dim))
    rope = rope_angles(jnp.asarray([[0, 1, 2, 3, 4], [9, 17, 33, 40, 63]]), config)
    order = rope_halves_order(config.head_dim)
    assert order.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    np.testing.assert_allclose(apply_rope(x[..., order], rope, halves=True), apply_rope(x, rope)[..., order], atol=1e-6)


@pytest.mark.slow
def test_a_model_with_wq_and_wk_reordered_for_halves_gives_the_same_logits():
    config = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32)
    params = init_params(config, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
    halves = Ops(rope_halves=True)
    prepared = halves.prepare(params, config)
    wq, reordered = params["layers_0"]["attention"]["wq"], prepared["layers_0"]["attention"]["wq"]
    np.testing.assert_array_equal(reordered, wq[:, rope_halves_order(config.head_dim)])
    want = model.sequence_logits(params, config, tokens)
    np.testing.assert_allclose(model.sequence_logits(prepared, config, tokens, halves), want, atol=1e-4)
