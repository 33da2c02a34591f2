"""int8 weights with a scale per output channel on XLA's products (`--quantize int8`, `core/int8_weights.py`): the
rounding is within half a step of each weight, a model runs on them close to its float weights (and on Q8_0 blocks
requantized), on one device and split over a mesh, and the weights a load holds are the int8 ones."""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.core import int8_weights
from jaxllama.core.int8_weights import Int8
from jaxllama.core.ops import XLA, Ops
from jaxllama.llm import LLM

INT8 = Ops(int8_weights=True)


def test_each_weight_is_within_half_a_step_of_its_channel():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4, 32)) * np.arange(1, 7)[:, None, None], jnp.float32)
    q = int8_weights.quantize(w, in_dims=2)
    assert q.quants.dtype == jnp.int8 and q.scales.shape == (6,)
    step = np.asarray(q.scales)[:, None, None]
    assert np.all(np.abs(np.asarray(int8_weights.dequantize(q)) - np.asarray(w)) <= step / 2 + 1e-6)
    assert np.asarray(jnp.abs(q.quants)).max() == 127


def test_a_product_on_int8_weights_is_the_product_on_their_dequantized_values():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 5, 64)), jnp.float32)
    w = int8_weights.quantize(jnp.asarray(rng.standard_normal((48, 64)), jnp.float32))
    want = XLA.linear(x, int8_weights.dequantize(w))
    np.testing.assert_allclose(np.asarray(INT8.linear(x, w)), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=1,model=1", "data=1,model=2"])
def test_a_model_loaded_with_int8_weights_stays_close_to_its_float_weights(tiny_chat_checkpoint, mesh):
    shape = {"max_slots": 4, "max_context": 64, "compilation_cache": False, "mesh": mesh}
    ref = LLM.load(tiny_chat_checkpoint, dtype="float32", **shape)
    llm = LLM.load(tiny_chat_checkpoint, dtype="float32", quantize="int8", **shape)
    wq = llm.params["layers_0"]["attention"]["wq"]
    assert isinstance(wq, Int8) and wq.quants.dtype == jnp.int8
    assert not isinstance(llm.params["embedding"], Int8)  # a lookup, not a product
    tokens = [ref.encode("the cat sat on the mat")]
    got, want = llm.logits(tokens), ref.logits(tokens)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert llm.generate("the cat", max_tokens=4, temperature=0).finish_reason in ("length", "stop")


def test_q8_0_blocks_are_requantized_per_channel(tiny_chat_checkpoint):
    """The tiny model's checkpoint stores Q8_0 blocks (a GGUF's): int8 reads them dequantized, then per channel."""
    llm = LLM.load(tiny_chat_checkpoint, quantize="int8", max_slots=4, max_context=64, compilation_cache=False)
    ref = LLM.load(tiny_chat_checkpoint, max_slots=4, max_context=64, compilation_cache=False)
    tokens = [ref.encode("a dog ran")]
    got, want = llm.logits(tokens), ref.logits(tokens)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu: pip install -e '.[tpu]'")
def test_int8_weights_halve_what_a_tpu_decode_step_reads():
    from jaxllama.core.config import ModelConfig
    from jaxllama.engine import aot

    config = ModelConfig(
        vocab_size=2048, dim=2048, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=4096, max_seq_len=256,
        dtype="bfloat16",
    )  # fmt: skip
    devices = aot.target_devices("v5e:2x2")[0]
    shape = {"target": "v5e:2x2", "mesh": "data=1,model=4", "max_slots": 8, "max_context": 256, "prefills": [(1, 16)]}
    bf16 = aot.compile_engine(config, devices, **shape)
    int8 = aot.compile_engine(config, devices, quantize="int8", **shape)
    assert int8.footprint.weights < 0.6 * bf16.footprint.weights
    assert int8.decode.hbm_bytes < 0.7 * bf16.decode.hbm_bytes
    assert int8.decode.cycles < 2 * bf16.decode.cycles  # widened as read, not scaled per element
