"""The CPU row-stats kernel (argmax, max, logsumexp per row) against numpy, and greedy sampling through it against
sampling through XLA."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.backends.cpu.row_stats import row_stats
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.sampling import RowHistory, SamplerFlags, SamplingRows, sample

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")


def logsumexp(x, axis):
    top = x.max(axis=axis, keepdims=True)
    return (top + np.log(np.exp(x - top).sum(axis=axis, keepdims=True))).squeeze(axis)


@pytest.fixture(scope="module", autouse=True)
def loaded(cpu_kernels):
    assert cpu_kernels


@pytest.mark.parametrize("rows, vocab", [(1, 5), (3, 8), (37, 1003), (64, 49152)])
def test_row_stats_match_numpy(rows, vocab):
    rng = np.random.default_rng(rows * vocab)
    logits = (rng.standard_normal((rows, vocab)) * 8).astype(np.float32)
    logits[0, -1] = 200.0  # the maximum in the tail past the last whole vector
    if rows > 1:
        logits[1, :] = -1e4  # every token ties: the first wins
        logits[1, 3 % vocab] = -50.0  # and the rest underflow against it
    argmax, top, logz = jax.jit(row_stats)(jnp.asarray(logits))
    np.testing.assert_array_equal(argmax, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(top, logits.max(axis=-1))
    np.testing.assert_allclose(logz, logsumexp(logits.astype(np.float64), axis=-1), rtol=1e-6, atol=1e-5)


def test_ties_go_to_the_first_maximum():
    logits = np.zeros((2, 20), np.float32)
    logits[0, [4, 9, 17]] = 1.0
    argmax, _, logz = jax.jit(row_stats)(jnp.asarray(logits))
    assert argmax.tolist() == [4, 0]
    np.testing.assert_allclose(logz[1], np.log(20.0), rtol=1e-6)


def test_greedy_sampling_through_the_kernel_matches_xla():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.standard_normal((6, 300)).astype(np.float32) * 3)
    rows = SamplingRows(**SamplingRows.from_params([SamplingParams(temperature=0.0)] * 6, [0] * 6))
    step = jnp.zeros(6, jnp.int32)
    plain = sample(logits, rows, RowHistory(step), SamplerFlags())
    kernel = sample(logits, rows, RowHistory(step), SamplerFlags(), ops=CpuOps())
    np.testing.assert_array_equal(kernel[0], plain[0])
    np.testing.assert_allclose(kernel[1], plain[1], rtol=1e-5, atol=1e-5)


def test_row_stats_take_nan_as_jnp_does():
    """A row with NaN logits: the first NaN's index, and NaN for its max and log-normalizer (jnp.argmax's and
    jnp.max's answers); a row of -inf: index 0, -inf; a row with +inf: its index, +inf (jax.nn.logsumexp's).
    Other rows are untouched."""
    logits = np.zeros((5, 21), np.float32)
    logits[0, 5], logits[0, 17] = np.nan, np.nan  # the first NaN inside a whole vector
    logits[1, 19] = np.nan  # in the tail
    logits[2, :] = -np.inf
    logits[3, 7] = 3.0
    logits[4, 11] = np.inf
    argmax, top, logz = jax.jit(row_stats)(jnp.asarray(logits))
    np.testing.assert_array_equal(argmax, jnp.argmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_array_equal(argmax, [5, 19, 0, 7, 11])
    np.testing.assert_array_equal(top, jnp.max(jnp.asarray(logits), axis=-1))
    np.testing.assert_array_equal(np.asarray(logz)[[2, 4]], jax.nn.logsumexp(jnp.asarray(logits[[2, 4]]), axis=-1))
    assert np.isnan(logz[:2]).all() and logz[2] == -np.inf and logz[4] == np.inf
    np.testing.assert_allclose(logz[3], logsumexp(logits[3:4].astype(np.float64), axis=-1)[0], rtol=1e-6)
