"""Products on weights as checkpoints store them: bfloat16 panels against numpy's float64 product of the same
weights widened, Q4_0 (`Blocks` or `quantize(..., "q4_0")`) against llama.cpp's semantics (inputs quantized to
Q8_0 per block by the `gguf` package, an integer sum per block, scaled), Q8_0 `Blocks` packed to the very panels
that quantizing their dequantized weights gives, and `CpuOps.prepare` on such params against XLA's forward pass on
the same weights in float32."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from jaxllama.backends.cpu import matmul
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core import blocks
from jaxllama.core.config import ModelConfig
from jaxllama.core.model import sequence_logits
from jaxllama.core.products import PRODUCT_IN_DIMS
from tests.helpers.engine import spread_params, tiny_config
from tests.helpers.kernels import inputs, padded, weights

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")
TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
# (rows, in, out): one row and one panel; odd inputs and a panel of one column past the first; a ragged tile and
# a last panel 4 columns wide; many rows, shared among threads.
SHAPES = [(1, 64, 16), (3, 47, 17), (5, 96, 100), (70, 320, 200)]


@pytest.fixture(scope="module", autouse=True)
def loaded(cpu_kernels):
    assert cpu_kernels


def to_blocks(w: np.ndarray, format: str, in_dims: int = 1) -> blocks.Blocks:
    """w [*out, *in] quantized by the gguf package (ggml's reference) as Blocks."""
    n_in = int(np.prod(w.shape[w.ndim - in_dims :]))
    raw = quants.quantize(np.asarray(w, np.float32).reshape(-1, n_in), TYPES[format])
    return blocks.from_gguf(raw, format, w.shape, in_dims)


def q8_0_inputs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, in] quantized as ggml's Q8_0 (padded to whole blocks): q [rows, blocks, 32] and d [rows, blocks]."""
    raw = quants.quantize(padded(x), GGMLQuantizationType.Q8_0).reshape(len(x), -1, 34)
    return raw[..., 2:].view(np.int8).astype(np.int64), raw[..., :2].copy().view(np.float16)[..., 0]


def ggml_product(x: np.ndarray, w: blocks.Blocks) -> np.ndarray:
    """llama.cpp's product of x [rows, in] by w's blocks [out, in]: per block, the integer sum of Q8_0 inputs by the
    weight's quants, times both scales (float64)."""
    xq, xd = q8_0_inputs(x)
    q = np.asarray(blocks.unpack_quants(w.quants, w.format)).astype(np.int64).reshape(len(w.scales), -1, 32)
    sums = np.einsum("rbi,obi->rob", xq, q)
    return np.einsum("rob,rb,ob->ro", sums.astype(np.float64), xd.astype(np.float64), w.scales.astype(np.float64))


def block_error_bound(x: np.ndarray, w: blocks.Blocks) -> np.ndarray:
    """float32 rounding of the sum over blocks (an exact integer sum in each block)."""
    xq, xd = q8_0_inputs(x)
    q = np.asarray(blocks.unpack_quants(w.quants, w.format)).astype(np.float64).reshape(len(w.scales), -1, 32)
    size = np.einsum("rbi,obi,rb,ob->ro", np.abs(xq), np.abs(q), np.abs(xd), np.abs(w.scales).astype(np.float64))
    return 2 * xq.shape[1] * 2**-24 * size + 1e-30


@pytest.mark.parametrize("rows, n_in, n_out", SHAPES)
def test_bfloat16_products_match_numpy(rows, n_in, n_out):
    rng = np.random.default_rng(rows + n_in)
    x = rng.standard_normal((rows, n_in), np.float32)
    w = rng.standard_normal((n_out, n_in), np.float32).astype(ml_dtypes.bfloat16)
    packed = matmul.pack(jnp.asarray(w))
    assert packed.panels.dtype == jnp.bfloat16 and packed.panels.shape[1] == n_in + n_in % 2
    got = np.asarray(jax.jit(matmul.matmul)(jnp.asarray(x), packed))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(n_in))


def test_bfloat16_gated_and_fused_products_match_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 65), np.float32)
    gate, up, a, b = (rng.standard_normal((n, 65), np.float32).astype(ml_dtypes.bfloat16) for n in (40, 40, 24, 9))
    x64, (g64, u64, a64, b64) = x.astype(np.float64), (w.astype(np.float64) for w in (gate, up, a, b))
    got = np.asarray(matmul.matmul(jnp.asarray(x), matmul.pack_gated(jnp.asarray(gate), jnp.asarray(up))))
    g, u = x64 @ g64.T, x64 @ u64.T
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-3)
    first, second = matmul.matmul(jnp.asarray(x), matmul.pack(jnp.asarray(a), jnp.asarray(b)))
    np.testing.assert_allclose(first, x64 @ a64.T, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(second, x64 @ b64.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows, n_in, n_out", [s for s in SHAPES if s[1] % 32 == 0])
def test_q4_0_blocks_multiply_as_llama_cpp(rows, n_in, n_out):
    rng = np.random.default_rng(rows + n_out)
    x, w = inputs(rng, rows, n_in), to_blocks(weights(rng, n_out, n_in), "q4_0")
    packed = matmul.pack(w)
    assert packed.panels.dtype == jnp.uint8 and packed.scales.dtype == jnp.float16
    np.testing.assert_array_equal(matmul.dequantize(packed)[:n_out], blocks.dequantize(w))  # the same bits
    got = np.asarray(jax.jit(matmul.matmul)(jnp.asarray(x), packed))
    want = ggml_product(x, w)
    np.testing.assert_array_less(np.abs(got - want), block_error_bound(x, w))
    exact = x.astype(np.float64) @ np.asarray(blocks.dequantize(w), np.float64).T  # inputs unquantized
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


def test_quantizing_to_q4_0_matches_ggml():
    """`quantize(pack(w), "q4_0")` against the gguf package's Q4_0 (which rounds in float64: a value within float32
    rounding of a half may land on the other side), odd shapes and gated panels included."""
    rng = np.random.default_rng(4)
    w = weights(rng, 100, 96)
    want = to_blocks(w, "q4_0")
    got = matmul.quantize(matmul.pack(jnp.asarray(w)), "q4_0")
    np.testing.assert_array_equal(np.asarray(got.scales).transpose(0, 2, 1).reshape(-1, 3)[:100], want.scales)
    same = matmul.dequantize(got)[:100] == np.asarray(blocks.dequantize(want))
    assert same.mean() > 0.999, same.mean()
    gate, up = weights(rng, 40, 47), weights(rng, 40, 47)
    x = inputs(rng, 5, 47)
    gated = matmul.quantize(matmul.pack_gated(*map(jnp.asarray, (gate, up))), "q4_0")
    gq, uq = (to_blocks(padded(w), "q4_0") for w in (gate, up))
    g, u = ggml_product(x, gq), ggml_product(x, uq)
    with np.errstate(over="ignore"):  # exp(-g) of a very negative g: silu's 0
        want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(matmul.matmul(jnp.asarray(x), gated), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("layout", ["q8_0", "w8a8"])
def test_q8_0_blocks_pack_to_the_panels_quantizing_gives(layout):
    rng = np.random.default_rng(5)
    w = to_blocks(weights(rng, 2 * 6 * 8, 64).reshape(2, 6, 8, 64), "q8_0")  # [kv, heads, head_dim, dim]
    packed = matmul.pack(w, layout=layout)
    want = matmul.quantize(matmul.pack(blocks.dequantize(w)), layout)
    assert packed.out_shapes == ((2, 6, 8),) and packed.panels.dtype == want.panels.dtype
    np.testing.assert_array_equal(packed.panels, want.panels)
    np.testing.assert_array_equal(packed.scales, want.scales)
    gate, up = (to_blocks(weights(rng, 40, 64), "q8_0") for _ in range(2))
    gated = matmul.pack_gated(gate, up, layout=layout)
    want = matmul.quantize(matmul.pack_gated(blocks.dequantize(gate), blocks.dequantize(up)), layout)
    np.testing.assert_array_equal(gated.panels, want.panels)


@pytest.mark.slow
@pytest.mark.parametrize("stored, tied", [("bfloat16", True), ("q8_0", True), ("q4_0", False), ("mixed", False)])
def test_prepare_reads_weights_as_stored(stored, tied):
    """Every product packed from its stored form (fused where stored alike), logits close to XLA's on the same
    weights in float32."""
    config = tiny_config(tie_embeddings=tied)
    params = spread_params(config, seed=6)

    def store(path, w):
        name = jax.tree_util.keystr(path[-1:])[2:-2]
        if name not in PRODUCT_IN_DIMS and name != "embedding":
            return w
        if stored == "bfloat16":
            return w.astype(jnp.bfloat16)
        if name == "embedding":
            return w  # lookups read it: kept in float32 here
        format = "q8_0" if stored == "q8_0" or (stored == "mixed" and name == "wv") else "q4_0"
        return to_blocks(np.asarray(w), format, PRODUCT_IN_DIMS[name])

    params = jax.tree_util.tree_map_with_path(store, params)
    widened = jax.tree.map(
        lambda w: blocks.dequantize(w) if isinstance(w, blocks.Blocks) else w.astype(jnp.float32),
        params,
        is_leaf=lambda w: isinstance(w, blocks.Blocks),
    )
    if tied and stored != "bfloat16":
        params["embedding"] = to_blocks(np.asarray(params["embedding"]), "q4_0")  # the output reads its blocks
        widened["embedding"] = blocks.dequantize(params["embedding"])
    ops = CpuOps()
    prepared = ops.prepare(params, config)
    layer = prepared["layers_0"]
    if stored == "mixed":
        assert {"wq", "wk", "wv"} <= set(layer["attention"]) and "wq+wk+wv" not in layer["attention"]
    else:
        assert "wq+wk+wv" in layer["attention"] and "w1+w3" in layer["mlp"]
    assert isinstance(prepared["output"], matmul.Packed)
    expected = {"bfloat16": jnp.bfloat16, "q8_0": jnp.int8, "q4_0": jnp.uint8, "mixed": jnp.uint8}[stored]
    assert prepared["layers_0"]["mlp"]["w2"].panels.dtype == expected
    if tied and stored != "bfloat16":
        assert prepared["output"].scales.dtype == jnp.float16
        prepared["embedding"] = widened["embedding"]  # this test's lookups: the same values in float32
    if stored == "bfloat16":
        prepared["embedding"] = widened["embedding"]
    tokens = jnp.asarray([[1, 5, 9, 30, 77, 2, 100]])
    got = np.asarray(sequence_logits(prepared, config, tokens, ops=ops))
    want = np.asarray(sequence_logits(widened, config, tokens))
    # bfloat16: the same float32 math; blocks: inputs quantized to int8 per block
    tolerance = 1e-4 if stored == "bfloat16" else 0.1
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.slow
def test_a_model_computing_in_bfloat16_runs_on_the_kernels():
    """Every weight bfloat16, the embedding too (the model computes in bfloat16, its cache too): the kernels compute
    in float32 and round their results to bfloat16, close to XLA's bfloat16 forward pass."""
    config = tiny_config()
    params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), spread_params(config, seed=7))
    ops = CpuOps()
    tokens = jnp.asarray([[1, 5, 9, 30, 77, 2, 100]])
    got = np.asarray(sequence_logits(ops.prepare(params, config), config, tokens, ops=ops))
    want = np.asarray(sequence_logits(params, config, tokens))
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


def test_weight_bytes_count_each_stored_form():
    """Per product weight: float32 4 bytes, bfloat16 2, Q8_0 1.125, Q4_0 0.5625 (stored so, or quantized at load);
    the embedding as stored."""
    config = ModelConfig(vocab_size=1024, dim=2048, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=8192)
    embedding = config.vocab_size * config.dim
    norms = (2 * config.n_layers + 1) * config.dim
    products = config.n_params - embedding - norms
    cases = [
        (None, np.float32, 4, 4, 4),
        (None, jnp.bfloat16, 2, 2, 2),
        ("q4_0", jnp.bfloat16, 0.5625, 2, 2),
        (None, "q8_0", 1.125, 34 / 32, 4),
        ("q4_0", "q8_0", 1.125, 34 / 32, 4),  # blocks are read as stored
        (None, "q4_0", 0.5625, 18 / 32, 4),
    ]
    for quantize, dtype, per_weight, per_embedding, per_norm in cases:
        want = products * per_weight + embedding * per_embedding + norms * per_norm
        assert CpuOps(quantize).weight_bytes(config, dtype) == pytest.approx(want, abs=1), (quantize, dtype)
    # A config naming some weights' forms: q, k and v as Q4_0, the embedding as Q8_0; the rest as the dtype given.
    if hasattr(ModelConfig, "stored_as"):
        names = [f"layers_{i}/attention/{w}" for i in range(config.n_layers) for w in ("wq", "wk", "wv")]
        forms = (*((n, "q4_0") for n in names), ("embedding", "q8_0"))
        mixed = dataclasses.replace(config, stored_as=forms)
        qkv = config.n_layers * config.dim * (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        want = qkv * 0.5625 + (products - qkv) * 2 + embedding * 34 / 32 + norms * 2
        assert CpuOps().weight_bytes(mixed, jnp.bfloat16) == pytest.approx(want)
