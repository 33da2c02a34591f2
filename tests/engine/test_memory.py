"""The host's memory on a CPU (`engine/memory.py`: `fit_host`): everything an engine will hold is counted before
anything is allocated (a paged pool whole, a contiguous cache at its largest, the decode state), against the memory
available. A context the user did not choose shrinks to what fits, with a warning giving the figures; one they chose
that cannot fit is refused with them, before the weights are restored. The available memory is patched to a figure
between two footprints: nothing here allocates more than a few hundred MB."""

from __future__ import annotations

import collections
import dataclasses
import logging

import jax
import jax.numpy as jnp
import psutil
import pytest

from jaxllama import LLM
from jaxllama.core.checkpoint import load_config
from jaxllama.core.ops import XLA
from jaxllama.core.params import product_form
from jaxllama.core.shapes import SHAPES
from jaxllama.core.sharding import make_mesh
from jaxllama.engine import memory
from jaxllama.engine.engine import Engine
from jaxllama.errors import ModelTooLarge
from tests.helpers.engine import EOS

ONE_DEVICE = "data=1,model=1"
_Memory = collections.namedtuple("_Memory", "available")


def _available(monkeypatch, available: int) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(available))


def _mesh(config):
    return make_mesh(config, ONE_DEVICE, jax.devices()[:1])


def test_the_issues_paged_pool_is_counted_whole_and_does_not_fit_23_gib():
    """The report's case: SmolLM2-135M on XLA's path (float32 weights, so a float32 cache) with a paged cache of
    64-position pages, 64 slots x 8192 positions: the pool, allocated at once, is 22.5 GiB."""
    config = SHAPES["smollm2-135m"]
    mesh = _mesh(config)
    pool = memory.host_footprint(config, mesh, XLA, memory.SlotsCache(64, 8192, jnp.float32, 64))
    per_layer = 64 * 8192 * 2 * config.n_kv_heads * config.head_dim * 4  # slots x positions x (k, v) x float32
    assert pool.cache == config.n_layers * per_layer == 24_159_191_040
    assert pool.growth == 0 and pool.temporaries == memory.OVERHEAD + per_layer  # XLA gathers a layer's pages
    assert pool.state == 64 * (config.vocab_size * 5 + 1024)  # token counts (int32) and seen (bool) per slot
    assert pool.total > 23 * 2**30
    grows = memory.host_footprint(
        config, mesh, XLA, memory.SlotsCache(64, 8192, jnp.float32)
    )  # contiguous: one layer's new copy
    assert grows.cache == pool.cache and grows.growth == per_layer and grows.temporaries == memory.OVERHEAD


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """A tiny random chat model whose context is 4096 positions: room to shrink."""
    from converters.llama import convert
    from tests.factories import write_chat_gguf

    tmp = tmp_path_factory.mktemp("long-chat")
    return convert(write_chat_gguf(tmp / "m.gguf", context=4096), tmp / "ckpt", progress=False)


def _paged_load_needs(checkpoint, context: int) -> int:
    """The bytes `LLM.load(checkpoint, cpu_kernels=False, page_size=64)` counts on one CPU device with the default
    64 slots of `context` positions."""
    config = load_config(checkpoint)
    mesh = _mesh(config)
    weights, restoring = memory.host_weights(config, XLA, product_form(config), mesh)
    needs = memory.host_footprint(
        config, mesh, XLA, memory.SlotsCache(64, context, jnp.float32, 64), memory.Held(weights, restoring)
    )
    return needs.total


def test_load_sizes_an_unchosen_context_down_to_the_available_memory(long_checkpoint, monkeypatch, caplog):
    """The pool of 64 slots x 4096 does not fit, 64 x 1024 does: the context is 1024 (the longest multiple of 128
    that fits), the warning says so with the figures, and the pool allocated holds 64 x 1024 positions."""
    fits = _paged_load_needs(long_checkpoint, 1024)
    assert _paged_load_needs(long_checkpoint, 1152) > fits + 2**20
    _available(monkeypatch, fits + 2**20)
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.memory"):
        llm = LLM.load(long_checkpoint, mesh=ONE_DEVICE, cpu_kernels=False, page_size=64, compilation_cache=False)
    assert (llm.slots, llm.max_context) == (64, 1024)
    assert llm.engine.runner.cache[0][0].shape[1] == 64 * 1024 // 64  # the pool's pages
    assert "context: 1024 positions, not 4096" in caplog.text and "the available memory is" in caplog.text


def test_load_refuses_a_chosen_context_that_cannot_fit_before_restoring_the_weights(long_checkpoint, monkeypatch):
    """--max-context 4096 was asked for and 64 x 4096 cannot fit: ModelTooLarge with the figures and the flags to
    lower, before any weight is restored or the pool allocated."""
    from jaxllama.engine import prepared

    _available(monkeypatch, _paged_load_needs(long_checkpoint, 1024))

    def restore(*args, **kw):
        raise AssertionError("the weights were restored before the memory check")

    monkeypatch.setattr(prepared, "restore", restore)
    with pytest.raises(ModelTooLarge, match=r"needs about .* GiB with 64 slots of 4096 positions \(.*KV cache") as e:
        LLM.load(long_checkpoint, mesh=ONE_DEVICE, cpu_kernels=False, page_size=64, max_context=4096)
    assert "a paged KV cache is allocated whole" in str(e.value)
    assert "--max-batch" in str(e.value) and "--max-context" in str(e.value)
    assert "the available memory is" in str(e.value)


@pytest.mark.parametrize("page_size", [0, 8])
def test_an_engine_on_a_cpu_sizes_or_refuses_its_cache_before_allocating_it(tiny, monkeypatch, page_size):
    """An Engine made directly (its weights already in memory): an unchosen context shrinks to what fits beside
    OVERHEAD; a chosen one whose cache cannot fit is refused."""
    config, params = tiny
    config = dataclasses.replace(config, max_seq_len=4096)  # the same weights: no table sized by the context
    mesh = _mesh(config)
    kw = dict(eos_ids=[EOS], cpu_kernels=False, page_size=page_size, max_slots=64)
    fits = memory.host_footprint(config, mesh, XLA, memory.SlotsCache(64, 512, jnp.float32, page_size)).total
    _available(monkeypatch, fits)
    engine = Engine(config, params, mesh, **kw)
    assert engine.max_context == 512
    whole = memory.host_footprint(
        config, mesh, XLA, memory.SlotsCache(64, 4096, jnp.float32, page_size), memory.Held(overhead=0)
    ).total
    _available(monkeypatch, whole - 1)
    with pytest.raises(ModelTooLarge, match="64 slots of 4096 positions"):
        Engine(config, params, mesh, max_context=4096, **kw)
    _available(monkeypatch, whole)  # the given context: only what the engine allocates counts
    assert Engine(config, params, mesh, max_context=4096, **kw).max_context == 4096
