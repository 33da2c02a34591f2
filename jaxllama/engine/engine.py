"""`Engine`: the scheduler (`scheduler.py`, plain Python) over the device half (`device.py`, the model's programs
on a mesh), with the backend chosen once, here, from the mesh and the weights (`jaxllama.backends.choose`).

    engine = Engine(config, params, mesh, eos_ids=[2])
    for update in engine.generate([Request("a", prompt_ids, SamplingParams(max_tokens=16))]):
        ...
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from jax.sharding import Mesh

from jaxllama import backends
from jaxllama.core.blocks import FORMATS
from jaxllama.core.config import ModelConfig
from jaxllama.core.model import activation_dtype
from jaxllama.core.ops import Ops
from jaxllama.core.params import product_form
from jaxllama.engine import buckets, kvcache
from jaxllama.engine.buckets import DEFAULT_SLOTS
from jaxllama.engine.device import Device
from jaxllama.engine.runtime import kernel_dir
from jaxllama.engine.scheduler import Scheduler
from jaxllama.engine.stats import EngineStats

# Decoder layers per compiled program (`step.py`): SmolLM2's 30 layers run as 6 calls of one program.
LAYERS_PER_PROGRAM = 5


def check_options(quantize: str | None = None, kv_cache_dtype: str | None = None) -> None:
    """Raise ValueError for an unknown weight format or KV cache dtype: callers check before a long load."""
    backends.check_quantization(quantize)
    kvcache.dtype(kv_cache_dtype, None)


class Engine(Scheduler):
    """Generates for many requests at once on a mesh. Not thread-safe: one thread drives `step()`.

    `cpu_kernels`: on one CPU device with float32 weights, run the CPU kernels where they build (else XLA's
    operations everywhere); `quantize` (one of `backends.QUANTIZATIONS`) needs them. `kv_cache_dtype`: the cache's
    dtype by name (default: the weights'). `decode_steps`: tokens per decode call (no host round trip between
    them). `min_cache`: the cache's first length in positions. The weights the engine runs are `self.params`:
    `params` prepared for the backend's products (packed or quantized for the CPU kernels); `donate_params`: the
    engine may free the given weights that preparing replaced (the caller will not use them again). `ops`: the
    backend, where the caller chose it already (`backends.choose`; `cpu_kernels` and `quantize` then say nothing).
    `abstract`: `params` are ShapeDtypeStructs with shardings and the engine only compiles its programs for the mesh's
    devices, which may be unable to run them (`engine/aot.py`). `page_size`: the KV cache's positions per page, 0 for
    a contiguous cache; by default the backend's (`Ops.page_size`: paged where a kernel reads the pages, on a TPU or
    GPU mesh of data=1)."""

    def __init__(
        self,
        config: ModelConfig,
        params,
        mesh: Mesh,
        *,
        eos_ids: Iterable[int] = (),
        max_slots: int = DEFAULT_SLOTS,
        max_context: int | None = None,
        decode_steps: int = 1,
        min_cache: int = buckets.MIN_BUCKET,
        layers_per_program: int = LAYERS_PER_PROGRAM,
        cpu_kernels: bool = True,
        quantize: str | None = None,
        kv_cache_dtype: str | None = None,
        donate_params: bool = False,
        ops: Ops | None = None,
        abstract: bool = False,
        page_size: int | None = None,
    ):
        check_options(quantize, kv_cache_dtype)
        if not isinstance(layers_per_program, int) or layers_per_program < 1:
            raise ValueError(f"layers_per_program={layers_per_program!r}: must be a positive integer")
        self.config, self.mesh = config, mesh
        stats = EngineStats()
        start = time.perf_counter()  # building the CPU kernels (once per machine) counts as compilation
        dtype = activation_dtype(params["embedding"])  # the model's (a backend keeps the embedding for lookups)
        form = product_form(config)  # the products' weights' as stored: a block format or a dtype
        form = form if form in FORMATS else dtype
        self.ops = ops or backends.choose(mesh, form, kernel_dir(), cpu_kernels=cpu_kernels, quantize=quantize)
        stats.compile_s += time.perf_counter() - start
        data = mesh.shape["data"]
        cache_dtype = kvcache.dtype(kv_cache_dtype, dtype)
        if page_size is None:
            page_size = self.ops.page_size(cache_dtype) if data == 1 else 0
        device = Device(
            config,
            params,
            mesh,
            ops=self.ops,
            slots=buckets.slot_count(max_slots, data),
            max_context=min(max_context or config.max_seq_len, config.max_seq_len),
            eos_ids=sorted(set(int(i) for i in eos_ids)),
            decode_steps=decode_steps,
            layers_per_program=layers_per_program,
            cache_dtype=cache_dtype,
            min_cache=min_cache,
            stats=stats,
            donate_params=donate_params,
            abstract=abstract,
            page_size=page_size,
        )
        super().__init__(device, stats)
        self.params = device.params
