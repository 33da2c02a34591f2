"""`Engine`: the scheduler (`scheduler.py`, plain Python: which requests hold which slots, when to prefill and when to
decode) over the model runner (`model_runner.py`, the model's programs on a mesh) that it builds for its weights on a
`LoadPlan` (`load_plan.py`: the mesh, the backend and the options with every choice made, the context fitted to
memory), which the engine decides nothing of again. Given weights without a plan, it has one made for them
(`plan_engine`).

    engine = Engine(config, params, mesh, EngineOptions(max_slots=8), eos_ids=[2])
    for update in engine.generate([Request("a", prompt_ids, SamplingParams(max_tokens=16))]):
        ...
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from jax.sharding import Mesh

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import activation_dtype
from jaxllama.core.ops import Ops
from jaxllama.engine import load_plan
from jaxllama.engine.load_plan import LoadPlan
from jaxllama.engine.model_runner import ModelRunner
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.scheduler import Scheduler


class Engine(Scheduler):
    """Generates for many requests at once on a mesh: a `Scheduler` (`add`, `step`, `finish`, `generate`, ...) over
    the `ModelRunner` made for `params` on a plan. Not thread-safe: one thread drives `step()`.

    `options` (`EngineOptions`; keyword fields given here replace its own) size and run it. The weights the engine
    runs are `self.params`: `params` prepared for the backend's products (packed or quantized for the CPU kernels);
    `donate_params`: the engine may free the given weights that preparing replaced (the caller will not use them
    again). `ops`: the backend, where the caller chose it already (`backends.choose`; `options.cpu_kernels` and
    `options.quantize` then say nothing). `plan`: the `LoadPlan` made for these weights (`Engine.planned`), from
    which its config, mesh, backend and options come (the other arguments then say nothing); an abstract plan's
    engine only compiles its programs (`engine/aot.py`)."""

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
        plan: LoadPlan | None = None,
        **fields,
    ):
        start = time.perf_counter()  # building the CPU kernels (once per machine) counts as compilation
        if plan is None:
            options = dataclasses.replace(options or EngineOptions(), **fields)
            activations = activation_dtype(params["embedding"])  # a backend keeps the embedding for lookups
            plan = load_plan.plan_engine(config, mesh, options, ops, activations)
        kernels_s = time.perf_counter() - start
        self.config, self.mesh, self.ops, self.options, self.plan = plan.config, plan.mesh, plan.ops, plan.options, plan
        eos_ids = sorted(set(int(i) for i in eos_ids))
        runner = ModelRunner(
            self.config,
            params,
            self.mesh,
            self.options,
            ops=self.ops,
            eos_ids=eos_ids,
            donate_params=donate_params,
            abstract=plan.abstract,
        )
        runner.stats.compile_s += kernels_s
        self.params = runner.params
        super().__init__(runner, runner.stats, self.options.step_tokens)

    @classmethod
    def planned(cls, plan: LoadPlan, params, **kwargs) -> Engine:
        """An engine on the plan `load_plan` made for `params` (its config, mesh, backend and options)."""
        return cls(plan.config, params, plan.mesh, plan=plan, **kwargs)
