"""KV heads repeated to fill the mesh's model axis (`core/kv_groups.py`): the same logits as the model's own heads,
on one device and through a load onto a mesh whose model axis exceeds the KV heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.core import kv_groups
from jaxllama.core.config import ModelConfig
from jaxllama.core.model import sequence_logits
from jaxllama.core.params import init_params
from jaxllama.llm import LLM

CONFIG = ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=64)


def test_how_many_repeats_a_model_axis_asks_for():
    assert [kv_groups.repeats(CONFIG, m) for m in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert kv_groups.repeats(CONFIG, 3) == 1  # not a multiple of the KV heads: replicated instead
    assert kv_groups.repeated_config(CONFIG, 4).n_kv_heads == 8


@pytest.mark.slow
@pytest.mark.parametrize("r", [2, 4])
def test_repeated_heads_give_the_same_logits(r):
    params = init_params(CONFIG, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 9)), jnp.int32)
    want = sequence_logits(params, CONFIG, tokens)
    repeated = kv_groups.repeat_heads(params, CONFIG, r)
    assert repeated["layers_1"]["attention"]["wk"].shape[0] == CONFIG.n_kv_heads * r
    got = sequence_logits(repeated, kv_groups.repeated_config(CONFIG, r), tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_load_onto_more_model_devices_than_kv_heads_splits_the_heads(tiny_chat_checkpoint):
    one = LLM.load(tiny_chat_checkpoint, mesh="data=1,model=1", max_slots=4, max_context=64, compilation_cache=False)
    kv = one.config.n_kv_heads
    model = 2 * kv
    if one.config.n_heads % model:
        pytest.skip(f"the tiny model's {one.config.n_heads} heads do not split {model} ways")
    many = LLM.load(
        tiny_chat_checkpoint, mesh=f"data=1,model={model}", max_slots=4, max_context=64, compilation_cache=False
    )
    assert many.config.n_kv_heads == model
    wk = many.params["layers_0"]["attention"]["wk"]
    assert wk.sharding.shard_shape(wk.shape)[0] == 1  # one head per device, not every head everywhere
    tokens = [one.encode("the cat sat on the mat")]
    np.testing.assert_allclose(many.logits(tokens), one.logits(tokens), rtol=1e-4, atol=1e-4)
    greedy = {"max_tokens": 8, "temperature": 0}
    assert many.generate("the cat", **greedy).text == one.generate("the cat", **greedy).text
