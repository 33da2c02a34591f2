"""`Engine`: a scheduler (`scheduler.py`, plain Python: which requests hold which slots, when to prefill and when to
decode) driving a model runner (`model_runner.py`, the model's programs on a mesh). The backend is chosen here, once,
from the mesh and the weights (`jaxllama.backends.choose`), unless the caller chose it, and the options are resolved
here for the model, the mesh and the backend (`options.py`), and on a CPU for the host's memory (`memory.fit_host`:
a context not chosen shrinks to what fits, a chosen one that cannot fit is refused) before the cache is allocated.

    engine = Engine(config, params, mesh, EngineOptions(max_slots=8), eos_ids=[2])
    for update in engine.generate([Request("a", prompt_ids, SamplingParams(max_tokens=16))]):
        ...
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator

from jax.sharding import Mesh

from jaxllama import backends
from jaxllama.core.blocks import FORMATS
from jaxllama.core.config import ModelConfig
from jaxllama.core.model import activation_dtype
from jaxllama.core.ops import Ops
from jaxllama.core.params import product_form
from jaxllama.engine import memory
from jaxllama.engine.model_runner import ModelRunner
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.request import FinishReason, Request, Update
from jaxllama.engine.runtime import kernel_dir
from jaxllama.engine.scheduler import Scheduler


class Engine:
    """Generates for many requests at once on a mesh. Not thread-safe: one thread drives `step()`.

    `options` (`EngineOptions`; keyword fields given here replace its own) size and run it. The weights the engine
    runs are `self.params`: `params` prepared for the backend's products (packed or quantized for the CPU kernels);
    `donate_params`: the engine may free the given weights that preparing replaced (the caller will not use them
    again). `ops`: the backend, where the caller chose it already (`backends.choose`; `options.cpu_kernels` and
    `options.quantize` then say nothing). `abstract`: `params` are ShapeDtypeStructs with shardings and the engine
    only compiles its programs for the mesh's devices, which may be unable to run them (`engine/aot.py`)."""

    def __init__(
        self,
        config: ModelConfig,
        params,
        mesh: Mesh,
        options: EngineOptions | None = None,
        *,
        eos_ids: Iterable[int] = (),
        ops: Ops | None = None,
        donate_params: bool = False,
        abstract: bool = False,
        **fields,
    ):
        options = dataclasses.replace(options or EngineOptions(), **fields)
        self.config, self.mesh = config, mesh
        start = time.perf_counter()  # building the CPU kernels (once per machine) counts as compilation
        dtype = activation_dtype(params["embedding"])  # the model's (a backend keeps the embedding for lookups)
        form = product_form(config)  # the products' weights' as stored: a block format or a dtype
        form = form if form in FORMATS else dtype
        cpu_kernels, quantize = options.cpu_kernels, options.quantize
        self.ops = ops or backends.choose(mesh, form, kernel_dir(), cpu_kernels=cpu_kernels, quantize=quantize)
        kernels_s = time.perf_counter() - start
        data, platform = mesh.shape["data"], mesh.devices.flat[0].platform
        cache_dtype, page_size = memory.cache_form(self.ops, options, dtype, data)
        self.options = options.resolved(config.max_seq_len, data, platform, cache_dtype, page_size)
        if platform == "cpu" and not abstract:  # the host's memory, before the cache is allocated (`memory.py`)
            chosen = options.max_context is not None
            self.options = _fit_host(config, mesh, self.ops, self.options, cache_dtype, chosen=chosen)
        eos_ids = sorted(set(int(i) for i in eos_ids))
        runner = ModelRunner(
            config,
            params,
            mesh,
            self.options,
            ops=self.ops,
            eos_ids=eos_ids,
            donate_params=donate_params,
            abstract=abstract,
        )
        stats = runner.stats
        stats.compile_s += kernels_s
        self.runner, self.stats, self.params = runner, stats, runner.params
        self.scheduler = Scheduler(runner, stats, self.options.step_tokens)

    # ---- the scheduler's interface ------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.runner.slots

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def check(self, request: Request) -> None:
        self.scheduler.check(request)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def finish(self, request_id, reason: FinishReason = "cancelled", stop_reason: str | None = None) -> None:
        self.scheduler.finish(request_id, reason, stop_reason)

    def is_waiting(self, request_id) -> bool:
        return self.scheduler.is_waiting(request_id)

    @property
    def running(self) -> int:
        return self.scheduler.running

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Update]:
        return self.scheduler.step()

    def generate(self, requests: Iterable[Request]) -> Iterator[Update]:
        return self.scheduler.generate(requests)


def _fit_host(config: ModelConfig, mesh: Mesh, ops: Ops, options: EngineOptions, cache_dtype, *, chosen: bool):
    """`options` with a context whose cache and decode state fit the host's available memory (`memory.fit_host`;
    the weights are in it already); ModelTooLarge, with the figures, where a `chosen` context does not fit. A
    context chosen here keeps memory.OVERHEAD free for the programs; one given (`LLM.load` sized it with that margin
    before the weights loaded, or the user chose it) is refused only where the cache itself cannot fit."""
    args = (config, mesh, ops, options.max_slots, options.max_context, cache_dtype, options.page_size)
    where = memory.fit_host(*args, chosen=chosen, overhead=0 if chosen else memory.OVERHEAD)
    return dataclasses.replace(options, max_context=where.context)
