"""Products of int8 weights by int8 inputs (`matmul.quantize(w, "w8a8")`): both quantized as llama.cpp's Q8_0, the
inputs by the kernel itself. Oracles: the `gguf` package's Q8_0 quantizer (ggml's reference) for weights and
inputs, to the bit, and numpy's float64 product of the two quantized matrices."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from jaxllama.backends.cpu import matmul
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.model import sequence_logits
from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.request import Request, SamplingParams
from tests.helpers.engine import run, spread_params, tiny_config
from tests.helpers.kernels import inputs, padded, q8_0, weights, with_q8_0_weights

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module", autouse=True)
def loaded(cpu_kernels):
    assert cpu_kernels


def test_weights_are_ggml_q8_0_to_the_bit():
    w = weights(np.random.default_rng(1), 100, 96)
    packed = matmul.quantize(matmul.pack(jnp.asarray(w)), "w8a8")
    assert packed.panels.dtype == jnp.uint8
    np.testing.assert_array_equal(matmul.dequantize(packed)[:100], q8_0(w))


def test_inputs_are_quantized_as_ggml_q8_0_to_the_bit():
    """Against a weight of 127 x 2^-7 on the diagonal (Q8_0 stores it exactly: q 127, scale 2^-7), each output
    is one input's Q8_0 value times the weight: float32 of (127 q) x (2^-7 x d), d the input block's float16 scale."""
    rng = np.random.default_rng(2)
    x = inputs(rng, 9, 96)
    x[1, :32] = np.arange(32) - 15.5  # with 127 below, d = 1: each value a tie, which rounds away from zero
    x[1, 31] = 127.0
    x[2, 32:64] = (np.arange(32) - 16) * 0.25 + 0.125  # d = 3.875 / 127: values near, not on, halves
    x[2, 64:] = 0.0
    x[2, 70] = 1e-30  # a block of one tiny value: its scale is 0 in float16
    w = np.eye(96, dtype=np.float32) * np.float32(127 / 128)
    got = np.asarray(matmul.matmul(jnp.asarray(x), matmul.quantize(matmul.pack(jnp.asarray(w)), "w8a8")))
    blocks = quants.quantize(x, GGMLQuantizationType.Q8_0).reshape(9, 3, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 1]
    q = blocks[..., 2:].view(np.int8).astype(np.float32)  # [rows, blocks, 32]
    want = (np.float32(127) * q) * (np.float32(2**-7) * d)
    np.testing.assert_array_equal(got, want.reshape(9, 96))


@pytest.mark.parametrize(
    "rows, n_in, n_out",
    [
        (1, 64, 16),  # one row, one panel
        (3, 40, 17),  # inputs padded to a whole block; a panel of one column past the first
        (5, 96, 100),  # a ragged tile; the last panel 4 columns wide
        (37, 576, 1536),  # SmolLM2's MLP: blocks of rows, a ragged last tile
        (64, 1536, 576),  # the down projection at 64 rows, shared among threads
        (100, 4096, 40),  # two blocks of rows (`matmul.cc`'s RowBlock: 64 rows of 4096 inputs)
    ],
)
def test_products_match_numpy_on_ggml_q8_0_inputs_and_weights(rows, n_in, n_out):
    rng = np.random.default_rng(rows + n_in)
    x, w = inputs(rng, rows, n_in), weights(rng, n_out, n_in)
    got = np.asarray(jax.jit(matmul.matmul)(jnp.asarray(x), matmul.quantize(matmul.pack(jnp.asarray(w)), "w8a8")))
    xq, wq = (q8_0(padded(a)).astype(np.float64) for a in (x, w))
    want = xq @ wq.T
    # Each block's integer sum is exact; the float32 sum over blocks rounds once per block.
    blocks = xq.shape[1] // matmul.Q_BLOCK
    np.testing.assert_array_less(np.abs(got - want), 2 * blocks * 2**-24 * (np.abs(xq) @ np.abs(wq).T) + 1e-30)


def test_gated_products_match_numpy():
    rng = np.random.default_rng(5)
    x = inputs(rng, 6, 64)
    gate, up = (weights(rng, 40, 64) for _ in range(2))
    got = np.asarray(
        matmul.matmul(jnp.asarray(x), matmul.quantize(matmul.pack_gated(*map(jnp.asarray, (gate, up))), "w8a8"))
    )
    g, u = (q8_0(x).astype(np.float64) @ q8_0(w).astype(np.float64).T for w in (gate, up))
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    rng = np.random.default_rng(7)
    x = jnp.asarray(inputs(rng, 70, 576))
    packed = matmul.quantize(matmul.pack(jnp.asarray(weights(rng, 200, 576))), "w8a8")
    product = jax.jit(matmul.matmul)
    everything = np.asarray(product(x, packed))
    for rows in (slice(0, 1), slice(5, 8), slice(3, 11), slice(20, 70)):
        np.testing.assert_array_equal(np.asarray(product(x[rows], packed)), everything[rows])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_infinite_input_spoils_its_own_row_only(bad):
    rng = np.random.default_rng(8)
    x = inputs(rng, 3, 64)
    x[1, 10] = bad
    got = np.asarray(
        matmul.matmul(jnp.asarray(x), matmul.quantize(matmul.pack(jnp.asarray(weights(rng, 16, 64))), "w8a8"))
    )
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


def test_prepare_quantizes_every_product():
    config = tiny_config()
    packed = CpuOps("w8a8").prepare(spread_params(config, seed=3), config)
    products = [p for p in jax.tree.leaves(packed, is_leaf=lambda x: isinstance(x, matmul.Packed))]
    products = [p for p in products if isinstance(p, matmul.Packed)]
    assert len(products) == 4 * config.n_layers + 1
    assert all(p.panels.dtype == jnp.uint8 and p.scales is not None for p in products)


@pytest.mark.slow
def test_smollm2_on_w8a8_picks_what_float32_on_the_same_weights_ranks_first_or_nearly(smollm2_float32_checkpoint):
    """The real model: every greedy token of a w8a8 engine, scored by the float32 forward pass (XLA) over the same
    weights (gguf's Q8_0) on the w8a8 engine's own text, is that pass's first choice or within 0.5 of its logit:
    quantizing the inputs (as llama.cpp does) moves the logits a little, enough to flip near ties only."""
    config, params = load_checkpoint(smollm2_float32_checkpoint)
    reference = with_q8_0_weights(params)
    reference["output"] = jnp.asarray(q8_0(np.asarray(params["embedding"])))
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173], [504, 3458, 282, 4990, 314], [28, 253, 1345, 30]]
    requests = [Request(i, p, SamplingParams(max_tokens=16, temperature=0.0)) for i, p in enumerate(prompts)]
    generated = run(Engine(config, params, mesh, max_slots=4, quantize="w8a8"), requests)[0]
    texts = [prompt + generated[i] for i, prompt in enumerate(prompts)]
    # one batch, zeros after the shorter texts (a position's logits see only the tokens before it): one shape to compile
    width = max(map(len, texts))
    batch = jnp.asarray([tokens + [0] * (width - len(tokens)) for tokens in texts])
    all_logits = np.asarray(sequence_logits(reference, config, batch))
    gaps = []
    for prompt, tokens, logits in zip(prompts, texts, all_logits, strict=True):
        steps = np.arange(len(prompt) - 1, len(tokens) - 1)  # the logits that chose each generated token
        gaps.extend(logits[steps].max(axis=1) - logits[steps, tokens[len(prompt) :]])
    assert len(gaps) == 16 * len(prompts) and max(gaps) <= 0.5, gaps
