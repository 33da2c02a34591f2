"""Products against int8 weights (`matmul.quantize`, llama.cpp's Q8_0): the weights against the `gguf` package's
Q8_0 quantizer (ggml's reference, to the bit), the products against numpy (float64) on those weights within the
error that quantizing the inputs to int16 allows, a row's result whatever shares its call, and engines on
quantized weights (a tiny model, the real SmolLM2) against float32 runs over gguf's Q8_0 weights."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.backends.cpu import matmul
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.request import Request, SamplingParams
from tests.helpers.engine import EOS, greedy_requests, reference_greedy, run, spread_params, tiny_config
from tests.helpers.kernels import q8_0, weights, with_q8_0_weights

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module", autouse=True)
def loaded(cpu_kernels):
    assert cpu_kernels


def input_error_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """How far x @ w.T [rows, out] may move when each row of x is quantized to int16 per block of 32 (a step of
    max |x| / 32767, rounded to nearest: half a step per input), plus float32 rounding."""
    kp = w.shape[1]
    x = np.pad(x.astype(np.float64), ((0, 0), (0, kp - x.shape[1])))
    blocks = x.reshape(len(x), -1, matmul.Q_BLOCK)
    half_step = np.abs(blocks).max(axis=2) / 32767 / 2  # [rows, blocks]
    w_blocks = np.abs(w.astype(np.float64)).reshape(len(w), -1, matmul.Q_BLOCK).sum(axis=2)  # [out, blocks]
    return half_step @ w_blocks.T * 1.01 + 1e-5 * np.abs(x) @ np.abs(w.astype(np.float64)).T + 1e-6


@pytest.mark.parametrize("n_out, n_in", [(100, 96), (576, 1536), (17, 64), (2048, 2048)])
def test_quantized_weights_are_ggml_q8_0_to_the_bit(n_out, n_in):
    w = weights(np.random.default_rng(n_out), n_out, n_in)
    packed = matmul.quantize(matmul.pack(jnp.asarray(w)))
    assert packed.panels.dtype == jnp.int8 and packed.scales.shape == (-(-n_out // 16), n_in // 32, 16)
    np.testing.assert_array_equal(matmul.dequantize(packed)[:n_out], q8_0(w))


@pytest.mark.parametrize(
    "rows, n_in, n_out",
    [
        (1, 64, 16),  # one row, one panel
        (3, 40, 17),  # inputs padded to a whole block; a panel of one column past the first
        (4, 96, 100),  # one tile; the last panel 4 columns wide
        (37, 576, 1536),  # SmolLM2's MLP: blocks of rows, a ragged last tile
        (64, 1536, 576),  # the down projection at 64 rows
        (100, 2048, 40),  # two blocks of rows (`matmul.cc`'s RowBlock: 64 rows of 2048 int16 inputs)
    ],
)
def test_quantized_matmul_matches_numpy_on_the_quantized_weights(rows, n_in, n_out):
    rng = np.random.default_rng(rows + n_in)
    x = rng.standard_normal((rows, n_in)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, 3] = 50.0  # an outlier: its block's other inputs get coarser steps
    packed = matmul.quantize(matmul.pack(jnp.asarray(weights(rng, n_out, n_in))))
    w = matmul.dequantize(packed)[:n_out]  # [out, in padded to blocks]
    got = np.asarray(jax.jit(matmul.matmul)(jnp.asarray(x), packed))
    want = x.astype(np.float64) @ w[:, :n_in].astype(np.float64).T
    assert np.all(np.abs(got - want) <= input_error_bound(x, w))


def test_quantized_gated_matmul_matches_numpy():
    rng = np.random.default_rng(5)
    rows, n_in, hidden = 6, 64, 40
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    gate, up = (weights(rng, hidden, n_in) for _ in range(2))
    packed = matmul.quantize(matmul.pack_gated(jnp.asarray(gate), jnp.asarray(up)))
    got = np.asarray(matmul.matmul(jnp.asarray(x), packed))
    g, u = (x.astype(np.float64) @ q8_0(w).astype(np.float64).T for w in (gate, up))
    dg, du = (input_error_bound(x, q8_0(w)) for w in (gate, up))
    silu = g / (1 + np.exp(-g))
    assert np.all(np.abs(got - silu * u) <= 1.1 * dg * (np.abs(u) + du) + np.abs(silu) * du + 1e-5 * np.abs(silu * u))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """The block sums are exact integers: a row gives the same bits alone, in a tile of 4 or in a block of 48."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((70, 576)).astype(np.float32))
    packed = matmul.quantize(matmul.pack(jnp.asarray(weights(rng, 200, 576))))
    product = jax.jit(matmul.matmul)
    everything = np.asarray(product(x, packed))
    for rows in (slice(0, 1), slice(5, 8), slice(3, 7), slice(20, 70)):
        np.testing.assert_array_equal(np.asarray(product(x[rows], packed)), everything[rows])


def test_a_nan_input_spoils_its_own_row_only():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 10] = np.nan
    packed = matmul.quantize(matmul.pack(jnp.asarray(weights(rng, 16, 64))))
    got = np.asarray(matmul.matmul(jnp.asarray(x), packed))
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


def test_prepare_quantizes_every_product():
    config = tiny_config()
    params = spread_params(config, seed=3)
    packed = CpuOps("q8_0").prepare(params, config)
    products = jax.tree.leaves(packed, is_leaf=lambda x: isinstance(x, matmul.Packed))
    products = [p for p in products if isinstance(p, matmul.Packed)]
    assert len(products) == 4 * config.n_layers + 1
    assert all(p.panels.dtype == jnp.int8 and p.scales is not None for p in products)


@pytest.mark.slow
def test_engine_on_quantized_weights_matches_the_forward_pass_on_them():
    """Greedy tokens of an engine with quantize='q8_0' equal those of the full forward pass (XLA, float32) over
    weights quantized by gguf: the kernels multiply by exactly those weights."""
    config = tiny_config()
    params = spread_params(config, seed=3)
    reference = with_q8_0_weights(params)
    requests = greedy_requests()
    expected = {r.id: reference_greedy(config, reference, r.prompt, r.params.max_tokens) for r in requests}
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=4, quantize="q8_0")
    tokens, _ = run(engine, requests)
    assert tokens == expected
    # the quantized weights change some tokens: the engine did use them (the first request that differs shows it)
    assert any(reference_greedy(config, params, r.prompt, r.params.max_tokens) != expected[r.id] for r in requests)


@pytest.mark.slow
def test_smollm2_on_quantized_weights_matches_float32_on_gguf_q8_0_weights(smollm2_float32_checkpoint):
    """The real model: greedy tokens of a quantize='q8_0' engine equal a float32 engine's over the same weights
    quantized by gguf (the output projection quantized, the embedding lookup not, as the kernels run it)."""
    config, params = load_checkpoint(smollm2_float32_checkpoint)
    reference = with_q8_0_weights(params)
    reference["output"] = jnp.asarray(q8_0(np.asarray(params["embedding"])))  # tied: the lookup stays float32
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173], [504, 3458, 282, 4990, 314], [28, 253, 1345, 30]]

    def greedy(engine):
        requests = [Request(i, p, SamplingParams(max_tokens=24, temperature=0.0)) for i, p in enumerate(prompts)]
        return run(engine, requests)[0]

    quantized = greedy(Engine(config, params, mesh, max_slots=4, quantize="q8_0"))
    assert quantized == greedy(Engine(config, reference, mesh, max_slots=4))
    assert quantized != greedy(Engine(config, params, mesh, max_slots=4))  # the quantized weights change tokens


def test_quantize_asks_for_a_known_format_and_the_cpu_kernels():
    config = tiny_config()
    params = spread_params(config, seed=3)
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    with pytest.raises(ValueError, match="quantize='q5_1': expected one of int8, q8_0"):
        Engine(config, params, mesh, quantize="q5_1")
    with pytest.raises(ValueError, match="runs through the CPU kernels"):
        Engine(config, params, mesh, quantize="q8_0", cpu_kernels=False)
