"""How a model is loaded and run, decided once: `LoadPlan`, made by `plan_load` for a model to load (`LLM.load`), to
compile for a target (`aot.py`) or to measure (`benchmarks/`), or by `plan_engine` for an engine built on weights
already on a mesh. An `Engine` given a plan decides none of it again.

The decisions, in their order (each needs the ones before it):
1. the KV cache's dtype as the user asked, or the weights' (what the memory plan counts);
2. the mesh, slots and context that fit the devices (`memory.plan`: on an accelerator its memory decides, the mesh
   with the fewest bytes a decode step reads among those that fit; on a CPU the mesh asked for);
3. the backend for that mesh and the weights' form (`backends.choose`);
4. the cache's dtype and page size for that backend (`memory.cache_form`);
5. every option resolved for the mesh and the platform (`EngineOptions.resolved`);
6. on a CPU, the context that fits the host's available memory beside the weights (`memory.fit_host`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllama import backends
from jaxllama.core.blocks import FORMATS
from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import Ops
from jaxllama.core.params import activation_dtype_of, product_form
from jaxllama.engine import buckets, kvcache, memory
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.runtime import kernel_dir

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """A model's mesh, backend and engine options with every choice made (`EngineOptions.resolved`: slots, context,
    decode steps, the KV cache's dtype and page size). `config`: the model as it runs on the mesh (its KV heads
    repeated where the model axis asks, `core/kv_groups.py`); `memory`: the memory plan's figures (its footprint
    per device, or on a CPU the host's); `abstract`: the weights are never restored, and an engine on the plan only
    compiles its programs for the mesh's devices, which may be unable to run them (`aot.py`)."""

    config: ModelConfig
    mesh: Mesh
    ops: Ops
    options: EngineOptions
    memory: memory.Plan
    abstract: bool = False

    @property
    def cache_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.options.kv_cache_dtype)

    @property
    def context(self) -> int:
        return self.options.max_context


def plan_load(
    config: ModelConfig,
    devices: Sequence,
    mesh: str | dict | None = None,
    options: EngineOptions | None = None,
    *,
    stored: ModelConfig | None = None,
    abstract: bool = False,
) -> LoadPlan:
    """The plan for loading `config` (the model as restored; `stored`: the checkpoint's, where it stores the weights
    otherwise) onto `devices`, on the mesh `mesh` asks for (default: chosen by memory), with `options`; ModelTooLarge,
    with the figures, where nothing fits. On a CPU the host's memory must hold the weights as the backend runs them,
    one layer being restored and the cache, unless the plan is `abstract` (weights never restored: a compile for a
    target)."""
    options = options or EngineOptions()
    activations = activation_dtype_of(config)
    asked = kvcache.dtype(options.kv_cache_dtype, activations)
    where = memory.plan(config, devices, mesh, options, asked, stored=stored)  # ModelTooLarge where nothing fits
    form = product_form(config)
    ops = backends.choose(where.mesh, form, kernel_dir(), cpu_kernels=options.cpu_kernels, quantize=options.quantize)
    plan = _resolved(where.config, where, ops, options, activations)
    if where.footprint is not None:  # an accelerator's memory, counted by `memory.plan`
        if options.max_context is None and where.context < config.max_seq_len:
            message = "context: %d positions (what fits beside the weights; the model's is %d)"
            log.info(message, where.context, config.max_seq_len)
        return dataclasses.replace(plan, abstract=abstract)
    if abstract:
        return dataclasses.replace(plan, abstract=True)
    weights, restoring = memory.host_weights(config, ops, form, plan.mesh, stored=stored)
    return _fit_host(plan, options.max_context is not None, weights=weights, restoring=restoring)


def plan_engine(config: ModelConfig, mesh: Mesh, options: EngineOptions, ops: Ops | None, activations) -> LoadPlan:
    """The plan of an engine built on weights already on `mesh`, of `config` as they are, computing in `activations`:
    the backend `ops` where the caller chose it. On a CPU the cache must fit beside the weights in the host's memory
    (a context chosen here leaves memory.OVERHEAD free for the programs; one asked for is refused only where the
    cache itself cannot fit)."""
    slots = buckets.slot_count(options.max_slots, mesh.shape["data"])
    where = memory.Plan(mesh, slots, options.max_context or config.max_seq_len, config=config)
    if ops is None:
        form = product_form(config)
        form = form if form in FORMATS else activations  # the dtype the weights compute in, as they are
        ops = backends.choose(mesh, form, kernel_dir(), cpu_kernels=options.cpu_kernels, quantize=options.quantize)
    plan = _resolved(config, where, ops, options, activations)
    if mesh.devices.flat[0].platform != "cpu":
        return plan
    chosen = options.max_context is not None
    return _fit_host(plan, chosen, overhead=0 if chosen else memory.OVERHEAD)


def _resolved(config: ModelConfig, where: memory.Plan, ops: Ops, options: EngineOptions, activations) -> LoadPlan:
    """The plan with the cache's form for the backend and every option resolved for the mesh."""
    data, platform = where.mesh.shape["data"], where.mesh.devices.flat[0].platform
    cache_dtype, page_size = memory.cache_form(ops, options, activations, data)
    options = dataclasses.replace(options, max_context=where.context)
    options = options.resolved(config.max_seq_len, data, platform, cache_dtype, page_size)
    return LoadPlan(config, where.mesh, ops, options, where)


def _fit_host(plan: LoadPlan, chosen: bool, **held) -> LoadPlan:
    """The plan with a context whose cache fits the host's available memory beside what else it holds (`held`:
    `memory.fit_host`'s weights, restoring and overhead); ModelTooLarge where a `chosen` context cannot fit."""
    o = plan.options
    cache = memory.SlotsCache(o.max_slots, o.max_context, plan.cache_dtype, o.page_size)
    where = memory.fit_host(plan.config, plan.mesh, plan.ops, cache, memory.Held(**held), chosen=chosen)
    return dataclasses.replace(plan, options=dataclasses.replace(o, max_context=where.context), memory=where)
