"""Loading holds one copy of the weights: a checkpoint is restored a part at a time, each part prepared for the
backend as it comes, and a model too large for the machine is refused before anything is restored."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from jaxllama import LLM
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core import checkpoint
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.config import ModelConfig
from jaxllama.core.sharding import make_mesh
from jaxllama.engine import memory
from jaxllama.errors import ModelTooLarge


@pytest.mark.parametrize("part_bytes", [1, 1 << 30])  # a layer per part; every layer in one part
def test_parts_are_restored_and_prepared_one_at_a_time(tiny_chat_checkpoint, monkeypatch, part_bytes):
    monkeypatch.setattr(checkpoint, "PART_BYTES", part_bytes)
    config, whole = load_checkpoint(tiny_chat_checkpoint)
    parts = []

    def prepare(part):
        parts.append(list(part))
        return part

    _, streamed = load_checkpoint(tiny_chat_checkpoint, prepare=prepare)
    layers = [f"layers_{i}" for i in range(config.n_layers)]
    assert sorted(parts[0]) == sorted(k for k in whole if not k.startswith("layers_"))
    assert parts[1:] == ([[name] for name in layers] if part_bytes == 1 else [layers])
    jax.tree.map(np.testing.assert_array_equal, streamed, whole)


def test_a_loaded_model_holds_its_weights_once_as_its_backend_runs_them(tiny_chat_checkpoint):
    llm = LLM.load(tiny_chat_checkpoint, mesh="data=1,model=1", max_slots=1, compilation_cache=False)
    if not isinstance(llm.engine.ops, CpuOps):
        pytest.skip("the CPU kernels are not built here: XLA's ops read the weights as restored")
    attention = llm.params["layers_0"]["attention"]
    assert "wq" not in attention and "wq+wk+wv" in attention  # packed, with no float32 copy beside it
    reply = llm.generate("The", max_tokens=4, temperature=0)
    logits = llm.logits([llm.encode("The") + reply.token_ids])[0]  # through the same packed weights
    assert reply.token_ids == np.argmax(logits[len(llm.encode("The")) - 1 : -1], axis=-1).tolist()


def test_a_model_too_large_for_the_machine_is_refused_before_loading(tiny_chat_checkpoint, monkeypatch):
    """The tiny model on a machine with 1 MiB available: refused before anything is restored, naming the bytes.
    (A config that makes the model larger than its files are is refused as a CheckpointError, before this check:
    see tests/core/test_checkpoint_errors.py.)"""
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1 << 20))
    with pytest.raises(ModelTooLarge, match=r"needs about \d+\.\d GiB .* is \d+\.\d GiB"):
        LLM.load(tiny_chat_checkpoint, max_slots=1, compilation_cache=False)


@pytest.mark.parametrize("quantize", [None, "w8a8"])
def test_the_memory_a_model_needs_is_what_its_backend_holds(quantize):
    """A Llama-3-70B-shaped config needs more than any machine this runs on; its figure is what the backend holds
    (int8 weights: about a quarter of float32's), not the checkpoint's size."""
    config = ModelConfig(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, head_dim=128
    )
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    ops = CpuOps(quantize)
    weights, restoring = memory.host_weights(config, ops, np.float32, mesh)
    assert weights == ops.weight_bytes(config, np.float32)
    with pytest.raises(ModelTooLarge) as e:
        memory.fit_host(
            config, mesh, ops, memory.SlotsCache(1, 512, np.float16), memory.Held(weights, restoring), chosen=False
        )
    assert f"weights {weights / 2**30:.2f}" in str(e.value)
    assert weights / config.n_params == pytest.approx(4 if quantize is None else 1.125, rel=0.05)  # + the embedding
