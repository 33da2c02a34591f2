"""The int8 KV cache (`core/int8_kv.py`, `--kv-cache-dtype int8`) on XLA's path: each cached vector within half a
step of its scale; logits near a float cache's; the engine's tokens those of the full-sequence forward, alone or
in a batch, from a stored prefix or computed afresh; refused by the CPU kernels, whose layout holds floats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.core import int8_kv
from jaxllama.core.model import empty_cache, forward
from jaxllama.core.sharding import make_mesh
from jaxllama.engine import kvcache
from jaxllama.engine.engine import Engine
from tests.helpers.engine import EOS, greedy_request, random_prompts, reference_greedy, run, token_logprobs


def _xla_engine(tiny, **kw):
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=2", jax.devices()[:2])  # two devices: XLA's path, not the CPU kernels
    return Engine(config, params, mesh, eos_ids=[EOS], kv_cache_dtype="int8", **kw)


def test_each_vector_is_kept_within_half_a_step_of_its_scale():
    x = jax.random.normal(jax.random.key(0), (3, 2, 5, 64)) * jnp.array([0.01, 1.0, 300.0])[:, None, None, None]
    x = x.at[0, 0, 0].set(0.0)  # a zero vector: scale 0, values 0
    values, scales = int8_kv.quantize(x)
    assert values.dtype == jnp.int8 and scales.shape == (3, 2, 5)
    error = jnp.abs(values.astype(jnp.float32) * scales[..., None] - x)
    assert bool(jnp.all(error <= scales[..., None] / 2 * (1 + 1e-6)))
    assert float(scales[0, 0, 0]) == 0.0 and not values[0, 0, 0].any()


@pytest.mark.slow
def test_logits_through_an_int8_cache_stay_near_a_float_caches(tiny):
    config, params = tiny
    tokens = jnp.asarray(random_prompts(4, seed=1, max_len=40)[0][:24])[None]
    positions = jnp.arange(tokens.shape[1])[None]
    exact = forward(params, config, tokens, positions, empty_cache(config, 1, 32))[0]
    cache = empty_cache(config, 1, 32, jnp.int8)
    assert isinstance(cache[0][0], int8_kv.Int8KV)
    rounded = forward(params, config, tokens, positions, cache)[0]
    spread = float(jnp.std(exact))
    assert float(jnp.max(jnp.abs(rounded - exact))) < 0.05 * spread
    assert (jnp.argmax(rounded, -1) == jnp.argmax(exact, -1)).mean() > 0.9


@pytest.mark.slow
def test_the_engine_decodes_through_an_int8_cache_batch_invariant(tiny):
    """Greedy tokens through the int8 cache match the full-sequence forward's (a float computation: the model's
    logits are far apart), and a request's tokens do not depend on what shares its steps (its log-probabilities to
    XLA's rounding, which differs with the products' row counts: exact batch invariance is the CPU kernels')."""
    config, params = tiny
    engine = _xla_engine(tiny, max_slots=8)
    assert engine.runner.cache[0][0].values.dtype == jnp.int8
    prompts = random_prompts(6, seed=4)
    tokens, _ = run(engine, [greedy_request(i, p) for i, p in enumerate(prompts)])
    agree = [tokens[i] == reference_greedy(config, params, p, 12) for i, p in enumerate(prompts)]
    assert sum(agree) >= len(prompts) - 1
    alone, _ = run(_xla_engine(tiny, max_slots=8), [greedy_request(2, prompts[2])])
    assert alone[2] == tokens[2]
    one = token_logprobs(_xla_engine(tiny, max_slots=8), greedy_request("x", prompts[2]))
    batch = [greedy_request(i, p) for i, p in enumerate(prompts)]
    together = [lp for u in _xla_engine(tiny, max_slots=8).generate(batch) if u.id == 2 for lp in u.logprobs]
    np.testing.assert_allclose(together, one, rtol=1e-5)


@pytest.mark.slow
def test_a_stored_prefix_gives_the_numbers_computed_afresh(tiny):
    rng = np.random.default_rng(6)
    first = rng.integers(3, 131, 30).tolist()
    second = first + rng.integers(3, 131, 9).tolist()
    fresh = token_logprobs(_xla_engine(tiny, max_slots=4), greedy_request("b", second))
    engine = _xla_engine(tiny, max_slots=4)
    token_logprobs(engine, greedy_request("a", first, 4))
    assert engine.prefixes.best(second)[1] >= 20
    again = token_logprobs(engine, greedy_request("b", second))
    np.testing.assert_allclose(again, fresh, rtol=1e-5)  # to XLA's rounding


def test_the_cpu_kernels_refuse_it_and_the_bytes_are_a_quarter_of_float32s(tiny):
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=4)
    if engine.ops.cache_layout.transposed_keys:  # the kernels built here
        with pytest.raises(ValueError, match="kv_cache_dtype=int8: XLA's path only"):
            Engine(config, params, mesh, eos_ids=[EOS], max_slots=4, kv_cache_dtype="int8")
    float32 = kvcache.bytes_per_layer(config, 8, 256, jnp.float32)
    int8 = kvcache.bytes_per_layer(config, 8, 256, jnp.int8)
    assert int8 == float32 // 4 + 2 * 8 * config.n_kv_heads * 256 * 4  # one float32 scale a vector
