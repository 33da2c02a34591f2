"""The CPU decode-attention kernel against XLA's attention (`Ops.attention`, one query per row), and
an engine that uses it against one that does not."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.backends.cpu import decode_attention, library
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core import int8_kv
from jaxllama.core.ops import XLA
from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.request import Request, SamplingParams
from tests.helpers.engine import pairs_config, random_prompts, spread_params, tiny_config

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    assert cpu_kernels
    return jax.jit(decode_attention.decode_attention)


def xla_attention(q, keys, values, slots, positions):
    """XLA's attention over the kernel's cache: keys transposed for the kernel, positions-major for XLA."""
    keys = jnp.swapaxes(keys, 2, 3)
    return XLA.attention(q[:, None], keys, values, positions[:, None], rows=slots)[:, 0]


def to_bfloat16(x) -> np.ndarray:
    """x rounded to bfloat16 (to nearest, even), as float64."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def bfloat16_attention(q, keys, values, slots, positions):
    """The attention the kernel computes over a bfloat16 cache where the CPU has AVX-512 BF16, in float64: the
    queries, and the softmax's weights before they multiply the values, rounded to bfloat16 as the cache is."""
    q, keys, values = to_bfloat16(q), np.asarray(keys, np.float64), np.asarray(values, np.float64)
    out = np.zeros(q.shape)
    for i, (slot, position) in enumerate(zip(slots, positions, strict=True)):
        if slot >= keys.shape[0]:
            continue  # a padding row
        seen = position + 1
        scores = np.einsum("kgd,kdt->kgt", q[i], keys[slot, :, :, :seen]) / np.sqrt(q.shape[-1])
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights = to_bfloat16(weights / weights.sum(-1, keepdims=True))
        out[i] = np.einsum("kgt,ktd->kgd", weights, values[slot, :, :seen])
    return out


def oracle(dtype, head_dim: int):
    """The attention the kernel computes over a cache of `dtype`, and how closely: XLA's in float32, or
    `bfloat16_attention`'s where the kernels compute it so (`library.attends_in_bfloat16`)."""
    if jnp.dtype(dtype) == jnp.bfloat16 and library.attends_in_bfloat16(head_dim):
        return bfloat16_attention, {"rtol": 2e-3, "atol": 2e-3}
    return jax.jit(xla_attention), {"rtol": 1e-5, "atol": 2e-6}


@pytest.mark.slow
@pytest.mark.parametrize(
    "rows, slots, kv, groups, head_dim, length",
    [
        (1, 1, 1, 1, 8, 8),  # one thread does it all
        (5, 8, 2, 4, 8, 48),
        (32, 64, 3, 3, 64, 128),  # SmolLM2's heads
        (64, 64, 3, 3, 64, 384),  # shared with the thread pool
        (7, 16, 4, 2, 16, 200),
        (3, 4, 2, 5, 24, 203),  # a length no multiple of the vector width, dims past 16, query heads 4 + 1
        (2, 2, 1, 8, 128, 64),  # Llama 3 70B's heads: 8 query heads per kv head, 128 dims
        (3, 2, 2, 16, 32, 70),  # 405B's 16 query heads per kv head: more than a group of query vectors holds
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])  # the cache's
def test_kernel_matches_xla(kernel, rows, slots, kv, groups, head_dim, length, dtype):
    """Against XLA's attention over the same cache (in 16 bits: the same rounded keys and values)."""
    rng = np.random.default_rng(rows + length)
    q = rng.standard_normal((rows, kv, groups, head_dim), np.float32)
    keys = jnp.asarray(rng.standard_normal((slots, kv, head_dim, length), np.float32), dtype)
    values = jnp.asarray(rng.standard_normal((slots, kv, length, head_dim), np.float32), dtype)
    rows_in = rng.choice(slots, size=rows, replace=rows > slots).astype(np.int32)
    if rows > 2:
        rows_in[-1] = slots  # a padding row: zeros out
    positions = rng.integers(0, length, rows).astype(np.int32)
    positions[0] = 0  # sees one position
    positions[-2 if rows > 2 else 0] = length - 1  # sees the whole cache
    got = np.asarray(kernel(q, keys, values, rows_in, positions))
    attention, tolerance = oracle(dtype, head_dim)
    np.testing.assert_allclose(got, attention(q, keys, values, rows_in, positions), **tolerance)
    if rows > 2:
        assert not got[-1].any()
    if dtype == jnp.bfloat16:  # the same cache given as its bits, as the engine keeps it
        bits = [jax.lax.bitcast_convert_type(x, int8_kv.BITS) for x in (keys, values)]
        np.testing.assert_array_equal(np.asarray(kernel(q, *bits, rows_in, positions)), got)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])  # the cache's
@pytest.mark.parametrize(
    "groups, head_dim, length", [(3, 64, 300), (1, 16, 77), (8, 32, 64), (5, 24, 203), (16, 32, 70)]
)
def test_prompt_rows_are_computed_as_one_at_a_time(kernel, groups, head_dim, length, dtype):
    """A prompt's consecutive rows (computed together, a run of them per group of query vectors) give each row's
    result bit for bit as that row alone does, whatever shares its call: prompts of several slots, one that starts
    past position 0 (over a reused prefix), a padding row among them and decode rows; and the oracle's (XLA's within
    float32's rounding) too."""
    rng = np.random.default_rng(groups + length)
    slots, kv = 4, 2
    q = rng.standard_normal((40, kv, groups, head_dim), np.float32)
    keys = jnp.asarray(rng.standard_normal((slots, kv, head_dim, length), np.float32), dtype)
    values = jnp.asarray(rng.standard_normal((slots, kv, length, head_dim), np.float32), dtype)
    rows = np.array([0] * 13 + [2] * 11 + [slots] + [1] * 9 + [3, 0, 2, 1, 3, 3], np.int32)
    positions = np.concatenate(
        [np.arange(13), np.arange(length - 11, length), [0], np.arange(40, 49), [5, 13, length - 1, 9, 0, 1]]
    ).astype(np.int32)
    together = np.asarray(kernel(q, keys, values, rows, positions))
    alone = np.concatenate(
        [
            np.asarray(kernel(q[i : i + 1], keys, values, rows[i : i + 1], positions[i : i + 1]))
            for i in range(len(rows))
        ]
    )
    np.testing.assert_array_equal(together, alone)
    attention, tolerance = oracle(dtype, head_dim)
    np.testing.assert_allclose(together, attention(q, keys, values, rows, positions), **tolerance)
    assert not together[24].any()  # the padding row


@pytest.mark.slow
def test_the_kernels_cache_is_float16_unless_asked(kernel):
    """Where no dtype is asked for, the kernels keep float32 activations' cache in float16 (XLA keeps their dtype);
    one asked for is kept."""
    config = tiny_config()
    params = spread_params(config, seed=3)
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    for use, asked, want in [(True, None, "float16"), (True, "float32", "float32"), (False, None, "float32")]:
        engine = Engine(config, params, mesh, eos_ids=[], max_slots=2, cpu_kernels=use, kv_cache_dtype=asked)
        assert isinstance(engine.ops, CpuOps) is use
        assert engine.options.kv_cache_dtype == want
    assert CpuOps().cache_dtype(jnp.bfloat16) == jnp.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "bfloat16"])
def test_engine_with_and_without_the_kernel_agree(kernel, kv_cache_dtype):
    """Prefills and decode steps attend through the kernel or XLA over the same cache (float32, float16, or
    bfloat16, which the kernels' engine keeps as its bits, at head dim 16: bfloat16 pairs where the CPU has them)."""
    # The engine tests' models, whose random initializers the session compiles once each.
    config = pairs_config() if kv_cache_dtype == "bfloat16" else tiny_config()
    params = spread_params(config, seed=3)
    prompts = random_prompts(12, seed=5)
    tokens = {}
    for use in (True, False):
        mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
        engine = Engine(config, params, mesh, eos_ids=[], max_slots=8, cpu_kernels=use, kv_cache_dtype=kv_cache_dtype)
        assert engine.options.kv_cache_dtype == kv_cache_dtype
        stored = int8_kv.BITS if use and kv_cache_dtype == "bfloat16" else jnp.dtype(kv_cache_dtype)
        assert engine.runner.cache[0][0].dtype == engine.runner.cache[0][1].dtype == stored
        requests = [Request(i, p, SamplingParams(max_tokens=6 + i, temperature=0.0)) for i, p in enumerate(prompts)]
        out = {i: [] for i in range(len(prompts))}
        for update in engine.generate(requests):
            out[update.id] += update.tokens
        assert isinstance(engine.ops, CpuOps) is use
        tokens[use] = out
    assert tokens[True] == tokens[False]


def test_a_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C.. compiler .'no-such-compiler'"):
        library.build(tmp_path)


def test_the_kernel_can_be_switched_off(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLAMA_CPU_KERNELS", "0")
    assert library.load(tmp_path) is False
