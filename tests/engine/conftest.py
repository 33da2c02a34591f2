import dataclasses

import jax
import numpy as np
import pytest

from jaxllama.core.config import ModelConfig
from jaxllama.core.params import init_params


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=131, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=128)
    return ModelConfig(**{**base, **kw})


def spread_params(config: ModelConfig, seed: int = 0):
    """Random weights scaled up so that logits are far apart: greedy choices are not near-ties. A tied model gets the
    untied model's weights but the output layer: XLA compiles each configuration's initializer once per session, for
    several seconds."""
    params = init_params(dataclasses.replace(config, tie_embeddings=False), jax.random.key(seed))
    if config.tie_embeddings:
        params = {name: value for name, value in params.items() if name != "output"}
    return jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, params)


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    return config, spread_params(config)


def random_prompts(n: int, seed: int = 0, vocab: int = 131, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(1, max_len))).tolist() for _ in range(n)]
