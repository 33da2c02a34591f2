"""Whether a model fits, asked before it is loaded, and the mesh and context it runs with.

A model too large for the machine is refused at once, with the bytes it needs and the bytes there are, rather than
found out by the kernel's out-of-memory killer or the device's allocator minutes later.

- On a CPU the devices share the host's memory, and everything the engine will allocate is counted against what is
  available (`fit_host`): the weights (as its backend holds them, a copy per replica along the mesh's `data` axis),
  or one layer being restored beside them; the KV cache at its largest (a contiguous cache grows by buckets up to
  the slots times the context, with one layer's new copy beside it as it grows; a paged pool is allocated whole, and
  XLA's attention gathers a layer's pages into a copy); the decode state; and OVERHEAD for the programs.
- On an accelerator each device holds its share: the weights as the mesh splits them (replicated parts in full),
  the KV cache at its final size (the slots times the context, as the mesh splits it), the moment the cache grows
  (one layer's new copy beside the old cache: `ModelRunner.resize`), the decode state, and the largest program's
  temporaries (`OVERHEAD` stands for them until the programs are compiled: `engine/aot.py` puts in the compiler's
  own figures). A device's memory is what it says it can hold, else the chip table's (`core/chips.py`), so that a
  compile-only device is sized as the real one.

Without a --mesh, an accelerator's mesh is the one among those that fit whose decode step moves the fewest bytes per
device (a decode step is bound by HBM bandwidth: the weights each device reads plus its part of the live KV cache);
of equals, the one with the larger `data` axis (fewer collectives). Without --max-context, the context is the longest
that fits (at most the model's), on a CPU as on an accelerator: a contiguous cache grows only as its sequences do, but
64 long sequences would reach its full size, and the out-of-memory killer ends the process then, not at load. A
context the user chose that cannot fit is refused, with the figures, before anything is loaded or allocated.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import psutil
from jax.sharding import Mesh

from jaxllama import backends
from jaxllama.core import kv_groups
from jaxllama.core.chips import chip_of, memory_of
from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import XLA, Ops
from jaxllama.core.params import abstract_stored, as_blocks, product_form, stored_arrays_of, stored_bytes
from jaxllama.core.sharding import make_mesh, model_axes, parse_mesh
from jaxllama.engine import buckets, kvcache
from jaxllama.engine.options import EngineOptions
from jaxllama.errors import ModelTooLarge

log = logging.getLogger(__name__)

# What a running engine holds besides its weights, cache and state (compiled programs, temporaries, the runtime's
# buffers), until the compiler says.
OVERHEAD = 1 << 30
# The shortest context an accelerator's default may shrink to before the model is refused.
MIN_CONTEXT = 2 * buckets.MIN_BUCKET


@dataclasses.dataclass(frozen=True)
class Footprint:
    """The bytes one device holds while the engine runs, by what holds them."""

    weights: int  # as the mesh splits them
    cache: int  # the KV cache at its final size
    growth: int  # one layer's grown copy, beside the cache while it grows
    state: int  # the decode slots' state (sampling rows, token counts)
    temporaries: int  # the largest program's temporaries and code (OVERHEAD until compiled)
    restoring: int = 0  # one layer being restored, before the cache exists

    @property
    def total(self) -> int:
        running = self.weights + self.cache + self.growth + self.state + self.temporaries
        return max(running, self.weights + self.restoring + self.temporaries)

    def describe(self) -> str:
        parts = [("weights", self.weights), ("KV cache", self.cache), ("cache growth", self.growth)]
        parts += [("decode state", self.state), ("programs", self.temporaries)]
        if self.restoring > self.cache + self.growth + self.state:  # the load's moment is the peak
            parts[1:4] = [("a layer being restored", self.restoring)]
        return ", ".join(f"{name} {b / 2**30:.2f}" for name, b in parts if b) + " GiB"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where and how big the engine runs: its mesh, decode slots and context (in positions), and what each device
    (on a CPU: the host) holds and can hold."""

    mesh: Mesh
    slots: int
    context: int
    footprint: Footprint | None = None  # on a CPU, None until the backend is chosen (`fit_host`)
    device_memory: int | None = None
    config: ModelConfig | None = None  # the model as it runs on the mesh: its KV heads repeated (`kv_groups`)

    @property
    def fits(self) -> bool:
        return self.footprint is None or self.device_memory is None or self.footprint.total <= self.device_memory


def per_device_bytes(tree) -> int:
    """The bytes of one device's shards of a pytree of arrays or ShapeDtypeStructs with shardings (the first device's:
    every device of a mesh holds shards of the same shapes)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    return total


def footprint(
    config: ModelConfig,
    mesh: Mesh,
    slots: int,
    context: int,
    cache_dtype,
    *,
    stored=None,
    ops: Ops = XLA,
    grows: bool = True,
) -> Footprint:
    """What one accelerator device of `mesh` holds running `config` (as restored) with `slots` slots of `context`
    positions, its weights as `ops` prepares them, and OVERHEAD of the programs' temporaries (what a compiled
    engine measures replaces it); `stored`: the checkpoint's config, when it stores the weights otherwise (one layer
    restores in it). `grows`: the cache grows by buckets (a contiguous cache: one layer's new copy beside the old
    cache at its last growth), not allocated once at its full size (a paged cache)."""
    cache = kvcache.abstract(config, mesh, slots, context, cache_dtype)
    layer = per_device_bytes(cache[0])
    data = mesh.shape["data"]
    state = math.ceil(slots / data) * (config.vocab_size * 5 + 1024)  # token counts (int32) and seen (bool)
    restoring = (_layer_bytes(config) + _layer_bytes(stored or config)) // mesh.shape["model"]  # restored sharded
    weights = per_device_bytes(ops.prepare_abstract(as_blocks(abstract_stored(config, mesh), config), config))
    return Footprint(weights, layer * config.n_layers, layer if grows else 0, state, OVERHEAD, restoring)


def plan(
    config: ModelConfig,
    devices,
    spec: str | dict | None,
    options: EngineOptions,
    cache_dtype,
    stored: ModelConfig | None = None,
) -> Plan:
    """The mesh, slots and context to run `config` with on `devices` (see the module's docstring) for the engine's
    `options` (its slots and context; its weights quantized at load as `options.quantize` says, "int8":
    `core/int8_weights.py`); ModelTooLarge, with the bytes needed and the bytes there are, where nothing fits."""
    devices, max_slots, max_context, quantize = list(devices), options.max_slots, options.max_context, options.quantize
    ops = Ops(int8_weights=backends.int8_at_load(product_form(config), devices[0].platform, quantize))
    memory = memory_of(devices[0])
    if memory is None:  # a CPU: the host's memory, counted by `fit_host` once the backend is chosen
        mesh = make_mesh(config, spec, devices)
        slots = buckets.slot_count(max_slots, mesh.shape["data"])
        run = kv_groups.repeated_config(config, kv_groups.repeats(config, mesh.shape["model"]))
        return Plan(mesh, slots, min(max_context or config.max_seq_len, config.max_seq_len), config=run)
    sizes = parse_mesh(spec)
    candidates = [sizes["model"]] if sizes else model_axes(config, len(devices))
    plans = []
    for model in candidates:
        mesh = make_mesh(config, spec, devices, model_axis=model)
        run = kv_groups.repeated_config(config, kv_groups.repeats(config, model))
        slots = buckets.slot_count(max_slots, mesh.shape["data"])
        context = min(max_context or config.max_seq_len, config.max_seq_len)
        if max_context is None:
            context = _longest_context(run, mesh, slots, context, cache_dtype, memory, stored, ops)
        needs = footprint(run, mesh, slots, context, cache_dtype, stored=stored, ops=ops)
        plans.append(Plan(mesh, slots, context, needs, memory, run))
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: p.footprint.total)
        raise ModelTooLarge(too_large(smallest))
    return min(fitting, key=lambda p: (decode_bytes(p), -p.mesh.shape["data"]))


def decode_bytes(p: Plan) -> int:
    """The bytes one device reads in a decode step of a full cache: its weights and its part of the KV cache."""
    return p.footprint.weights + p.footprint.cache


def too_large(p: Plan) -> str:
    """Why a plan does not fit, with both figures."""
    sizes = f"data={p.mesh.shape['data']},model={p.mesh.shape['model']}"
    device = p.mesh.devices.flat[0]
    kind = chip.name if (chip := chip_of(device)) else device.device_kind
    return (
        f"the model needs about {p.footprint.total / 2**30:.1f} GiB per device on mesh {sizes} with {p.slots} slots "
        f"of {p.context} positions ({p.footprint.describe()}); each {kind} device holds "
        f"{p.device_memory / 2**30:.1f} GiB. Use more devices, fewer slots (--max-batch), a shorter context "
        f"(--max-context), a 16-bit KV cache or smaller weights"
    )


def _longest_context(config, mesh, slots, limit, cache_dtype, memory, stored, ops) -> int:
    """The longest context (a multiple of MIN_BUCKET, at most `limit`) whose cache fits beside everything else; a
    plan at MIN_CONTEXT where none does (which then does not fit)."""
    fixed = footprint(config, mesh, slots, 0, cache_dtype, stored=stored, ops=ops)
    per_position = footprint(config, mesh, slots, buckets.MIN_BUCKET, cache_dtype, stored=stored, ops=ops)
    per_position = (per_position.cache + per_position.growth) / buckets.MIN_BUCKET
    room = memory - (fixed.weights + fixed.state + fixed.temporaries)
    context = int(room // per_position) // buckets.MIN_BUCKET * buckets.MIN_BUCKET if room > 0 else 0
    return max(min(context, limit), min(MIN_CONTEXT, limit))


def cache_form(ops: Ops, options: EngineOptions, activations, data: int) -> tuple:
    """The KV cache's dtype and page size (0: contiguous) an engine of `ops` runs with for `options`, the model
    computing in `activations` on a mesh of `data` replicas: the ones asked for, else the backend's."""
    cache_dtype = kvcache.dtype(options.kv_cache_dtype, ops.cache_dtype(activations))
    page_size = options.page_size if options.page_size is not None else ops.page_size(cache_dtype) if data == 1 else 0
    return cache_dtype, page_size


def host_weights(config: ModelConfig, ops: Ops, dtype, mesh: Mesh, stored: ModelConfig | None = None) -> tuple:
    """(weights, restoring): the host bytes of the weights `ops` runs from those `config` describes (`dtype`: the form
    of its products, `params.product_form`), a copy per replica along the mesh's `data` axis, and of one layer being
    restored beside them (as the checkpoint `stored` holds it, and as restored)."""
    # XLA reads the weights as restored; a backend that prepares its own in host memory says their bytes.
    weights = ops.weight_bytes(config, dtype) if ops.prepared_on_host else stored_bytes(config)
    return weights * mesh.shape["data"], _layer_bytes(config) + _layer_bytes(stored or config)


@dataclasses.dataclass(frozen=True)
class SlotsCache:
    """The KV cache an engine holds: `slots` rows of `context` positions in `dtype`, in pages of `page_size`
    positions (0: contiguous)."""

    slots: int
    context: int
    dtype: object
    page_size: int = 0


@dataclasses.dataclass(frozen=True)
class Held:
    """What a host holds beside an engine's cache and state: its `weights` (0: already in memory), one layer being
    `restoring` beside them, and `overhead` for the programs."""

    weights: int = 0
    restoring: int = 0
    overhead: int = OVERHEAD


def host_footprint(config: ModelConfig, mesh: Mesh, ops: Ops, cache: SlotsCache, held: Held = Held()) -> Footprint:
    """What this host holds running an engine of `ops` on the CPU mesh `mesh` with `cache`: what it `held`, the KV
    cache at its largest (paged: a pool allocated whole; else a contiguous cache at its last growth, one layer's new
    copy beside it), the decode state, and, for a pool, the copy of a layer's pages XLA's attention gathers."""
    page_size = cache.page_size
    layout = dataclasses.replace(ops.cache_layout, page_size=page_size) if page_size else ops.cache_layout
    here = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)  # this host's devices
    shape = (config, mesh, cache.slots, cache.context, cache.dtype, layout)
    layer = per_device_bytes(kvcache.abstract(*shape)[0]) * here
    state = math.ceil(cache.slots / mesh.shape["data"]) * (config.vocab_size * 5 + 1024) * here  # counts and seen
    growth, temporaries = (0, held.overhead + layer) if page_size else (layer, held.overhead)
    return Footprint(held.weights, layer * config.n_layers, growth, state, temporaries, held.restoring)


def fit_host(
    config: ModelConfig, mesh: Mesh, ops: Ops, cache: SlotsCache, held: Held = Held(), *, chosen: bool
) -> Plan:
    """The plan of an engine on a CPU mesh (`host_footprint`'s arguments) against the host's available memory: as
    asked where it fits; else, where the context was not `chosen` by the user, the longest that fits (a multiple of
    MIN_BUCKET, at least MIN_CONTEXT), with a warning giving the figures; else ModelTooLarge, with them."""
    have = psutil.virtual_memory().available
    slots, context, page_size = cache.slots, cache.context, cache.page_size
    needs = lambda c: host_footprint(config, mesh, ops, dataclasses.replace(cache, context=c), held)
    asked = Plan(mesh, slots, context, needs(context), have, config)
    if asked.fits:
        return asked
    if chosen:
        raise ModelTooLarge(_host_too_large(asked, page_size))
    shortest = min(MIN_CONTEXT, context)
    low, high = shortest // buckets.MIN_BUCKET, (context - 1) // buckets.MIN_BUCKET  # multiples below `context`
    best = Plan(mesh, slots, shortest, needs(shortest), have, config)
    if not best.fits:
        raise ModelTooLarge(_host_too_large(best, page_size))
    while low <= high:  # the footprint grows with the context
        mid = (low + high) // 2
        p = Plan(mesh, slots, mid * buckets.MIN_BUCKET, needs(mid * buckets.MIN_BUCKET), have, config)
        low, high, best = (mid + 1, high, p) if p.fits else (low, mid - 1, best)
    log.warning(
        "context: %d positions, not %d: %d slots of %d would need about %.1f GiB (%s), the available memory is "
        "%.1f GiB (--max-context and --max-batch choose them)",
        best.context,
        context,
        slots,
        context,
        asked.footprint.total / 2**30,
        asked.footprint.describe(),
        have / 2**30,
    )
    return best


def _host_too_large(p: Plan, page_size: int) -> str:
    """Why a plan does not fit the host's memory, with both figures."""
    pool = "; a paged KV cache is allocated whole" if page_size and p.footprint.cache else ""
    return (
        f"the model needs about {p.footprint.total / 2**30:.1f} GiB with {p.slots} slots of {p.context} positions "
        f"({p.footprint.describe()}{pool}); the available memory is {p.device_memory / 2**30:.1f} GiB. Use fewer "
        f"slots (--max-batch), a shorter context (--max-context), a 16-bit or int8 KV cache (--kv-cache-dtype) or "
        f"smaller weights"
    )


def _layer_bytes(config: ModelConfig) -> int:
    """The bytes of one layer of weights as `config` stores them."""
    return sum(
        int(np.prod(shape)) * jnp.dtype(dtype).itemsize
        for name, (shape, dtype) in stored_arrays_of(config).items()
        if name.startswith("layers_0/")
    )
