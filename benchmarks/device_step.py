"""A real accelerator's decode rate against what `jaxllama compile` estimated for the same engine: the check of the
estimates that compiling on a CPU cannot make.

    python -m benchmarks.device_step [--model llama-3.1-8b] [--max-batch 64] [--prompt 512] [--max-tokens 128]
                                     [--quantize int8] [--kv-cache-dtype int8] [--mesh data=1,model=1]

On this machine's devices (a GPU or TPU; on a CPU it runs too, slowly, for a check of the script itself), with
random weights of a known shape (`core/shapes.py`) in bfloat16: first `compile_engine`'s report for the same mesh,
slots and context (the decode step's ideal, HBM-traffic and cycle estimates, over a cache as long as the cache
bucket a prompt and its tokens fill), then the engine itself over
`max_batch` random prompts of `prompt` tokens, each generating `max_tokens` (greedy, no end-of-generation id): the
measured decode tok/s per sequence and in all, the prefill tokens/s, and each as a ratio to the estimates. Prints
one JSON object.
"""

from __future__ import annotations

import json
import time

import fire
import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.core import kv_groups
from jaxllama.core.chips import skip_absent_tpu
from jaxllama.core.params import init_params
from jaxllama.core.shapes import known_shape
from jaxllama.engine import aot, buckets
from jaxllama.engine.engine import Engine
from jaxllama.engine.load_plan import plan_load
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.request import Request, SamplingParams


def main(
    model: str = "llama-3.1-8b",
    max_batch: int = 64,
    prompt: int = 512,
    max_tokens: int = 128,
    quantize: str | None = None,
    mesh: str | None = None,
    seed: int = 0,
    kv_cache_dtype: str | None = None,
):
    config = known_shape(model)
    if config is None:
        raise SystemExit(f"--model {model}: not a known shape")
    config = config.with_dtype("bfloat16")
    skip_absent_tpu()
    devices = jax.devices()
    max_context = buckets.bucket(prompt + max_tokens + 8, config.max_seq_len)  # the cache the job grows to
    options = EngineOptions(
        max_slots=max_batch, max_context=max_context, quantize=quantize, kv_cache_dtype=kv_cache_dtype
    )
    report = aot.compile_engine(
        config, devices, options, target=devices[0].device_kind, mesh=mesh,
        prefills=[(min(8, max_batch), prompt)],
    )  # fmt: skip
    plan = plan_load(config, devices, mesh, options)
    params = init_params(config, jax.random.key(seed), jnp.bfloat16, plan.mesh)
    r = kv_groups.repeats(config, plan.mesh.shape["model"])
    if r > 1:
        params = kv_groups.repeat_heads(params, config, r)  # on one host: jit places it as the mesh says
    engine = Engine.planned(plan, params)
    rng = np.random.default_rng(seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            engine.add(Request(i, rng.integers(0, config.vocab_size, prompt).tolist(), greedy))
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start

    run(max_batch)  # compiles every program this job runs
    stats = engine.stats
    before = (stats.decode_s, stats.decode_steps, stats.generated_tokens, stats.prefill_s, stats.prefill_tokens)
    wall = run(max_batch)
    decode_s, steps, tokens, prefill_s, prefill_tokens = (
        now - was for now, was in zip(
            (stats.decode_s, stats.decode_steps, stats.generated_tokens, stats.prefill_s, stats.prefill_tokens),
            before, strict=True,
        )
    )  # fmt: skip
    step_s = decode_s / max(1, steps)
    estimates = {k: s for k, s in report.decode.estimates().items() if s == s}  # no NaN: a CPU has no chip entry
    print(
        json.dumps(
            {
                "device": devices[0].device_kind,
                "devices": len(devices),
                "mesh": dict(plan.mesh.shape),
                "model": model,
                "quantize": quantize,
                "kv_cache_dtype": kv_cache_dtype,
                "slots": engine.runner.slots,
                "context": plan.context,
                "wall_s": wall,
                "decode_step_s": step_s,
                "decode_tok_s": tokens / decode_s if decode_s else None,
                "tok_s_per_sequence": 1 / step_s if step_s else None,
                "prefill_tok_s": prefill_tokens / prefill_s if prefill_s else None,
                "estimated_step_s": estimates,
                "measured_over_estimate": {k: step_s / s for k, s in estimates.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    fire.Fire(main)
