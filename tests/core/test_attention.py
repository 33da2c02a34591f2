"""XLA's attention (`Ops.attention`) over a long prompt, a block of queries at a time, against all at once."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.core import ops
from jaxllama.core.ops import XLA


@pytest.mark.slow
def test_a_long_prompt_attends_a_block_of_queries_at_a_time_with_the_same_result():
    rng = np.random.default_rng(0)
    b, t, kv, g, hd = 2, 3 * ops.QUERY_BLOCK, 2, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, kv, g, hd)), jnp.float32)
    keys, values = (jnp.asarray(rng.standard_normal((b, kv, t, hd)), jnp.float32) for _ in range(2))
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    got = XLA.attention(q, keys, values, positions)
    want = XLA._attend(q, keys, values, positions)  # every query at once
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
