"""The CPU matmul kernel on packed weights against numpy's products (float64), and `CpuOps.linear` through it against
XLA's `Ops.linear`."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.backends.cpu import matmul
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core.ops import XLA
from tests.helpers.engine import spread_params, tiny_config

CPU = CpuOps()

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module", autouse=True)
def loaded(cpu_kernels):
    assert cpu_kernels


@pytest.mark.parametrize(
    "rows, n_in, n_out",
    [
        (1, 8, 16),  # one row, one panel
        (3, 40, 17),  # a panel of one column past the first
        (4, 64, 100),  # rows = one tile; the last panel 4 columns wide
        (37, 576, 1536),  # SmolLM2's MLP: several blocks of rows and a ragged last tile
        (64, 1536, 576),  # the MLP's down projection at 64 rows (shared among threads)
        (130, 96, 33),
        (200, 2048, 24),  # blocks of 48 rows (`matmul.cc`'s RowBlock: the fewest, for 2048 float inputs)
    ],
)
def test_matmul_matches_numpy(rows, n_in, n_out):
    rng = np.random.default_rng(rows + n_in + n_out)
    x = rng.standard_normal((rows, n_in), np.float32)
    w = rng.standard_normal((n_out, n_in), np.float32)
    packed = matmul.pack(jnp.asarray(w))
    assert packed.panels.shape == (-(-n_out // matmul.PANEL), n_in, matmul.PANEL)
    got = np.asarray(jax.jit(matmul.matmul)(jnp.asarray(x), packed))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(n_in))


def test_matmul_keeps_leading_dims_and_unflattens_outputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 8), np.float32))  # [b, t, heads, head_dim]
    wo = jnp.asarray(rng.standard_normal((16, 4, 8), np.float32))  # [dim, heads, head_dim]: in_dims=2
    wq = jnp.asarray(rng.standard_normal((4, 8, 32), np.float32))  # [heads, head_dim, dim]
    np.testing.assert_allclose(
        CPU.linear(x, matmul.pack(wo, in_dims=2), in_dims=2), XLA.linear(x, wo, in_dims=2), rtol=1e-5, atol=1e-5
    )
    h = jnp.asarray(rng.standard_normal((2, 3, 32), np.float32))
    out = CPU.linear(h, matmul.pack(wq))
    assert out.shape == (2, 3, 4, 8)
    np.testing.assert_allclose(out, XLA.linear(h, wq), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_prepare_packs_every_product_and_the_output(tied):
    config = tiny_config(tie_embeddings=tied)
    params = spread_params(config, seed=1)
    assert ("output" in params) is not tied
    packed = CPU.prepare(params, config)
    kinds = {
        jax.tree_util.keystr(p): type(w)
        for p, w in jax.tree_util.tree_leaves_with_path(packed, is_leaf=lambda x: isinstance(x, matmul.Packed))
    }
    products = [k for k, t in kinds.items() if t is matmul.Packed]
    assert len(products) == 4 * config.n_layers + 1  # q+k+v, wo, gate+up (gated) and w2 per layer, and the output
    assert all(packed[f"layers_{i}"]["mlp"]["w1+w3"].gated for i in range(config.n_layers))
    assert all("norm" not in k and "embedding" not in k for k in products)
    assert isinstance(packed["output"], matmul.Packed) and isinstance(packed["embedding"], jax.Array)


def test_weights_packed_as_one_product_are_split_again():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 7, 24), np.float32))
    weights = [jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in [(4, 6, 24), (2, 6, 24), (3, 24)]]
    parts = CPU.linear(x, matmul.pack(*weights))
    assert [p.shape for p in parts] == [(5, 7, 4, 6), (5, 7, 2, 6), (5, 7, 3)]
    for got, w in zip(parts, weights, strict=True):
        np.testing.assert_allclose(got, XLA.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows, n_in, hidden", [(1, 8, 8), (5, 24, 13), (37, 576, 1536), (64, 1536, 100)])
def test_gated_matmul_matches_numpy(rows, n_in, hidden):
    rng = np.random.default_rng(rows + hidden)
    x = rng.standard_normal((rows, n_in), np.float32)
    gate, up = (rng.standard_normal((hidden, n_in), np.float32) for _ in range(2))
    packed = matmul.pack_gated(jnp.asarray(gate), jnp.asarray(up))
    assert packed.gated and packed.panels.shape == (-(-hidden // 8), n_in, matmul.PANEL)
    got = np.asarray(jax.jit(matmul.matmul)(jnp.asarray(x), packed))
    g, u = (x.astype(np.float64) @ w.astype(np.float64).T for w in (gate, up))
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * n_in)


def test_gated_matmul_saturates_without_overflow():
    """Gate values far past exp's range give silu(g) = g (large g) and 0 (very negative g), not inf or NaN."""
    gate = np.array([[1.0], [-1.0], [0.0], [1e-3], [-1e-3], [0.5], [-20.0], [20.0]], np.float32)
    packed = matmul.pack_gated(jnp.asarray(gate), jnp.ones_like(jnp.asarray(gate)))  # up = x
    for scale in (1.0, 200.0, 1e15):
        g = gate[:, 0].astype(np.float64) * scale
        silu = np.where(g >= 0, g / (1 + np.exp(-np.abs(g))), g * np.exp(-np.abs(g)) / (1 + np.exp(-np.abs(g))))
        got = np.asarray(matmul.matmul(jnp.full((1, 1), scale, jnp.float32), packed))[0]
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, silu * scale, rtol=1e-6, atol=1e-30)


@pytest.mark.slow
def test_kernel_threads_can_be_capped(kernel_folder):
    """JAXLLAMA_KERNEL_THREADS=1: a shared product starts no helper thread (by default, one per core less one:
    counted against the threads the process had before its first product); the result is the same."""
    script = f"""
import os, jax, jax.numpy as jnp, numpy as np
from pathlib import Path
from jaxllama.backends.cpu import library, matmul
assert library.load(Path({str(kernel_folder)!r}))
w = jnp.asarray(np.random.default_rng(0).standard_normal((512, 512), np.float32))
x = jnp.ones((64, 512), jnp.float32)
packed = jax.block_until_ready(matmul.pack(w))
f = jax.jit(matmul.matmul).lower(x, packed).compile()
jnp.ones(4).block_until_ready()
before = len(os.listdir("/proc/self/task"))
y = f(x, packed).block_until_ready()
print(len(os.listdir("/proc/self/task")) - before, float(jnp.abs(y - x @ w.T).max()))
"""
    counts = {}
    for limit in ("", "1"):
        env = {**os.environ, "JAXLLAMA_KERNEL_THREADS": limit}
        env.pop("XLA_FLAGS", None)  # one device, as a user runs: XLA's pool has a thread per core
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        new, error = out.stdout.split()
        counts[limit] = int(new)
        assert float(error) < 1e-2
    assert counts[""] - counts["1"] == len(os.sched_getaffinity(0)) - 1, counts
