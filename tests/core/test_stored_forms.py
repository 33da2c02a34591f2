"""Weights keep the form they are stored in, from the source through the checkpoint to XLA's products: GGUF blocks
as blocks, bfloat16 as bfloat16, `--quantize` exactly as gguf quantizes; checked against gguf's own quantizer and
dequantizer and against transformers."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from converters import quantize as quantizer
from converters.llama import convert
from jaxllama import LLM
from jaxllama.core.blocks import Blocks, dequantize, from_gguf
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.model import sequence_logits
from jaxllama.core.ops import XLA
from jaxllama.core.params import stored_bytes
from jaxllama.core.sharding import make_mesh
from tests.factories import GGUF_TYPE_MIX, Tiny, hf_state, write_gguf, write_hf

TINY = Tiny(heads=8, kv_heads=2, vocab=131, ffn=96)  # ffn 96: w2's inputs split on 2 devices are not whole blocks
TOKENS = np.array([[1, 5, 9, 100, 77, 3, 42, 8], [2, 130, 7, 7, 7, 1, 99, 15]])
logits = jax.jit(sequence_logits, static_argnums=1)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("forms") / "hf"
    write_hf(TINY, out)
    return out


@pytest.mark.parametrize("format", ["q8_0", "q4_0"])
@pytest.mark.parametrize("shape,in_dims", [((6, 64), 1), ((4, 2, 48), 2)])
def test_quantize_is_gguf_quantize(format, shape, in_dims, monkeypatch):
    monkeypatch.setattr(quantizer, "CHUNK", 96)  # several chunks, one ending mid-tensor
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    w[0, :3] = 0.0
    ours = quantizer.quantize(w, format, in_dims)
    raw = gguf.quants.quantize(w.reshape(shape[0], -1), quantizer._TYPES[format])
    expected = from_gguf(raw, format, shape, in_dims)
    assert ours.in_shape == shape[1:] if in_dims == 2 else ours.in_shape == shape[-1:]
    np.testing.assert_array_equal(ours.quants, expected.quants)
    np.testing.assert_array_equal(ours.scales, expected.scales)


GGUF_TYPES = {**GGUF_TYPE_MIX, "output.": "Q4_0"}  # the converters' mix, with a Q4_0 output
EXPECTED_FORMS = {"wq": "q4_0", "wk": "q8_0", "wv": "bfloat16", "wo": "q8_0", "w1": "q8_0", "w3": "bfloat16"}


def test_gguf_keeps_its_blocks_and_runs_them_in_xla(tmp_path):
    write_gguf(TINY, hf_state(write_hf(TINY, tmp_path / "hf")), tmp_path / "m.gguf", GGUF_TYPES)
    config, params = load_checkpoint(convert(tmp_path / "m.gguf", tmp_path / "ckpt", progress=False))
    layer = f"layers_{TINY.layers - 1}"
    forms = {name.rpartition("/")[2]: form for name, form in config.stored_as if name.startswith(layer)}
    assert forms == EXPECTED_FORMS | {"w2": "q8_0"} and config.dtype == "float32"  # norms stay float32
    assert config.form("embedding") == "q8_0" and config.form("output") == "q4_0"
    wq = params[layer]["attention"]["wq"]
    assert isinstance(wq, Blocks) and wq.format == "q4_0" and wq.quants.shape == (TINY.heads, 8, 32)
    # The blocks are the file's: dequantized, they are gguf's dequantization of the tensor, exactly.
    tensor = next(
        t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors if t.name == f"blk.{TINY.layers - 1}.attn_q.weight"
    )
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(TINY.heads, 8, TINY.dim)
    np.testing.assert_array_equal(np.asarray(dequantize(wq)), expected)
    assert params[layer]["attention"]["wv"].dtype == jnp.bfloat16
    # Through XLA, blocks dequantized inside the products: the logits of the same weights dequantized at load.
    _, widened = load_checkpoint(tmp_path / "ckpt", dtype="float32")
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(widened))
    ours = np.asarray(logits(params, config, TOKENS))
    np.testing.assert_allclose(ours, np.asarray(logits(widened, config.with_dtype("float32"), TOKENS)), atol=2e-2)
    # ... and close to the file's own weights (Q4_1, Q5_0 and Q5_1 requantized once to Q8_0).
    _, exact = load_checkpoint(convert(tmp_path / "m.gguf", tmp_path / "f32", dtype="float32", progress=False))
    np.testing.assert_allclose(ours, np.asarray(logits(exact, config.with_dtype("float32"), TOKENS)), atol=5e-2)


def test_bfloat16_runs_in_bfloat16_close_to_transformers(tmp_path):
    model = write_hf(TINY, tmp_path / "f32").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    config, params = load_checkpoint(convert(tmp_path / "hf", tmp_path / "ckpt", progress=False))
    assert config.dtype == "bfloat16" and not config.stored_as
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    ours = np.asarray(logits(params, config, TOKENS))
    with torch.no_grad():
        ref = model(torch.tensor(TOKENS)).logits.float().numpy()  # transformers, in bfloat16 too
        exact = model.float()(torch.tensor(TOKENS)).logits.numpy()  # the same bfloat16 weights, in float32
    scale = np.abs(exact).max()
    assert np.abs(ours - exact).max() < 0.05 * scale
    assert np.abs(ours - exact).max() < 2 * np.abs(ref - exact).max() + 1e-3 * scale


@pytest.mark.slow
@pytest.mark.parametrize("format,spec", [("q8_0", "data=2,model=4"), ("q4_0", "data=1,model=2")])
def test_quantized_checkpoints_shard_and_match_their_dequantized_weights(hf_folder, tmp_path, format, spec):
    ckpt = convert(hf_folder, tmp_path / "ckpt", quantize=format, progress=False)
    config, params = load_checkpoint(ckpt)
    assert all(isinstance(params["layers_0"]["mlp"][k], Blocks) for k in ("w1", "w2", "w3"))
    assert isinstance(params["embedding"], Blocks) and params["norm"]["scale"].dtype == jnp.float32
    ours = np.asarray(logits(params, config, TOKENS))
    _, widened = load_checkpoint(ckpt, dtype="float32")  # gguf's dequantization, through the float32 path
    np.testing.assert_allclose(ours, np.asarray(logits(widened, config.with_dtype("float32"), TOKENS)), atol=1e-4)
    mesh = make_mesh(config, spec, devices=jax.devices()[: 2 if spec.endswith("2") else 8])
    _, sharded = load_checkpoint(ckpt, mesh=mesh)
    # wo's 64 inputs split over 2 devices are whole blocks, over 4 not; w2's 96 over 2 are not.
    wo = sharded["layers_0"]["attention"]["wo"]
    assert wo.quants.sharding.spec[-1] == ("model" if mesh.shape["model"] == 2 else None)
    assert sharded["layers_0"]["mlp"]["w2"].quants.sharding.spec[-1] is None
    assert sharded["layers_0"]["mlp"]["w1"].quants.sharding.spec[0] == "model"  # its out axis, as a weight's
    with mesh:
        np.testing.assert_allclose(np.asarray(logits(sharded, config, TOKENS)), ours, atol=1e-4)


@pytest.mark.slow
def test_llm_on_xla_holds_the_blocks_it_restored(tiny_chat_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLAMA_CPU_KERNELS", "0")
    ckpt = convert(tiny_chat_checkpoint.parent / "m.gguf", tmp_path / "ckpt", quantize="q8_0", progress=False)
    llm = LLM.load(ckpt, mesh="data=1,model=1", max_slots=1, compilation_cache=False)
    assert llm.engine.ops == XLA and isinstance(llm.params["layers_0"]["attention"]["wq"], Blocks)
    assert stored_bytes(llm.config) < llm.config.n_params * 1.2  # what the memory check counts for XLA's path
    reply = llm.generate([1, 5, 9], max_tokens=4, temperature=0)
    row = [1, 5, 9] + reply.token_ids
    assert reply.token_ids == np.argmax(llm.logits([row])[0][2:-1], axis=-1).tolist()
    widened = LLM.load(ckpt, mesh="data=1,model=1", dtype="float32", max_slots=1, compilation_cache=False)
    assert widened.params["layers_0"]["attention"]["wq"].dtype == jnp.float32
    np.testing.assert_allclose(widened.logits([row]), llm.logits([row]), atol=1e-4)
