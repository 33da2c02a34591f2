"""The engine compiled for a target without its weights (`LLM.compile_for`, `jaxllama compile`), and a job's time
and cost on it (`LLM.predict_job`, `jaxllama compile --job`): a model's shape or a checkpoint's config, the target's
devices (a TPU slice or GPUs described on this host, or the local devices) and the engine's options resolved as a
load would resolve them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp

from jaxllama.core.checkpoint import load_config
from jaxllama.core.chips import chip_of
from jaxllama.core.config import ModelConfig, check_dtype
from jaxllama.engine.options import EngineOptions


def compile_for(
    model: str | Path | ModelConfig | None = None,
    *,
    topology: str | None = None,
    mesh: str | dict | None = None,
    dtype=None,
    quantize: str | None = None,
    stored_as: str | None = None,
    prefills: Sequence[tuple[int, int]] | None = None,
    options: EngineOptions | None = None,
    **engine_options,
):
    """Compile the engine for a target without its weights and report whether the model fits and how fast it
    would decode (`engine/aot.py`): `model` a known shape name (`core/shapes.py`: "llama-3.1-8b"), a
    checkpoint (only its config is read) or a config; `topology` a TPU slice such as "v5e:2x4" (needs libtpu),
    default the local devices. `dtype` converts every weight; `quantize` is what `LLM.load` takes
    (`EngineOptions.quantize`): the form the products' weights are made into at load ("int8", a scale per output
    channel, on XLA's path; the CPU kernels' "q8_0", "w8a8" or "q4_0" on one CPU device); `stored_as` "q8_0" or
    "q4_0": the products' weights stored as llama.cpp's blocks, as a converted GGUF of that type holds them (a
    TPU or GPU reads them as int8 weights made at load). `options` (`EngineOptions`, its fields also given as
    keywords: `max_slots`, `max_context`, `kv_cache_dtype`) size the engine. Returns an `aot.EngineReport`
    (`.table()`, `.to_json()`); raises ModelTooLarge, with the figures, where no mesh fits."""
    from jaxllama.engine import aot

    config, devices, target, options = _target(model, topology, dtype, stored_as, quantize, options, engine_options)
    return aot.compile_engine(config, devices, options, target=target, mesh=mesh, prefills=prefills)


def predict_job(
    model: str | Path | ModelConfig | None,
    jobs: Sequence[tuple[list[int], int]],
    *,
    topology: str | None = None,
    mesh: str | dict | None = None,
    dtype=None,
    quantize: str | None = None,
    stored_as: str | None = None,
    price: float | None = None,
    options: EngineOptions | None = None,
    **engine_options,
):
    """A job's time and cost on a target before it runs (`engine/job_clock.py`): `jobs` are its requests'
    prompt token ids and output lengths, run by the engine's scheduler on the clock of its compiled programs'
    costs, estimated for a TPU slice (`topology`) or measured on the local devices. The other arguments are
    `compile_for`'s; `price`: dollars per chip-hour. Returns a `job_clock.JobPrediction`."""
    from jaxllama.engine import aot, job_clock

    config, devices, target, options = _target(model, topology, dtype, stored_as, quantize, options, engine_options)
    engine, plan = aot.abstract_engine(config, devices, options, mesh)
    chip = chip_of(plan.mesh.devices.flat[0])
    cost = job_clock.measured_cost() if topology is None else job_clock.estimated_cost(chip)
    step_tokens = engine.options.step_tokens
    return job_clock.predict(engine.runner, jobs, cost, step_tokens=step_tokens, chips=plan.mesh.size, price=price)


def _target(model, topology, dtype, stored_as, quantize, options, engine_options):
    """`compile_for`'s arguments resolved: the model's config (as restored), the target's devices and name, and the
    engine's options (`quantize` among them where given)."""
    given = engine_options | ({"quantize": quantize} if quantize is not None else {})
    options = dataclasses.replace(options or EngineOptions(), **given)
    from jaxllama.core.shapes import SHAPES, known_shape
    from jaxllama.default_model import resolve_model
    from jaxllama.engine import aot

    if isinstance(model, ModelConfig):
        config = model
    elif isinstance(model, str) and known_shape(model) is not None:
        config = known_shape(model)
    else:
        if model is not None and not Path(model).exists():
            raise ValueError(f"{model}: neither a checkpoint nor a known shape ({', '.join(SHAPES)})")
        config = load_config(resolve_model(model))
    if dtype is not None:
        check_dtype(dtype)
        config = config.with_dtype(jnp.dtype(dtype).name)
    if stored_as is not None:
        config = aot.quantized(config, stored_as)
    devices, target = aot.target_devices(topology)
    return config, devices, target, options
