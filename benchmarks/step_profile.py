"""Where an engine step's time goes: each compiled program's calls timed alone.

    python -m benchmarks.step_profile [--requests 32] [--prompt 40] [--max-tokens 64] [--slots 32]
    python -m benchmarks.step_profile --job JOB.jsonl [--slots 64] [--layers 5] [--quantize w8a8|q8_0]
                                      [--kv-cache-dtype float16]

Runs the engine on the default model (SmolLM2-135M-Instruct, float32) over random prompts, or over a job's chat
requests (chat template applied, each line's max_tokens, greedy, longest first as `jaxllama run` runs them), twice:
once to compile, once timed (the first run's prompts forgotten: every prompt computed again), with every program
call waited for (so the sum is a little above an unsynchronized run's wall time). Prints, for each kind of program
(`engine/step.py`; layer programs by rows x tokens and the positions they attend over: the cache's length in a
decode, the span in a prefill), its calls, total seconds and milliseconds per call in the timed run, and its compile
seconds in the first run. `--layers`: decoder layers per compiled program.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import fire
import jax
import numpy as np

from jaxllama.engine import kvcache
from jaxllama.engine.engine import Engine
from jaxllama.engine.options import LAYERS_PER_PROGRAM
from jaxllama.engine.request import Request, SamplingParams


class TimedPrograms:
    """An engine's programs (`engine/programs.py`), each call waited for and its time added to `times[kind]`."""

    def __init__(self, programs):
        self.programs, self.stats = programs, programs.stats
        self.times, self.calls = collections.defaultdict(float), collections.Counter()
        self.compiles = collections.defaultdict(float)  # compile seconds, by the same keys

    def __call__(self, kind, fn, args, static_key, donate, out):
        compiling, start = self.stats.compile_s, time.perf_counter()
        result = jax.block_until_ready(self.programs(kind, fn, args, static_key, donate, out))
        if kind.endswith("layers"):  # by shape: rows x tokens, over a cache (decode) or a span (prefill) of some length
            x, cache = args[1], args[3]
            span = x.shape[1] if cache is None else kvcache.length(cache)
            kind = f"{kind} {x.shape[0]}x{x.shape[1]} /{span}"
        self.compiles[kind] += self.stats.compile_s - compiling
        self.times[kind] += time.perf_counter() - start - (self.stats.compile_s - compiling)
        self.calls[kind] += 1
        return result


def main(
    requests: int = 32,
    prompt: int = 40,
    max_tokens: int = 64,
    slots: int = 32,
    seed: int = 0,
    job: str | None = None,
    layers: int = LAYERS_PER_PROGRAM,
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
):
    from jaxllama import LLM

    llm = LLM.load(mesh="data=1,model=1", compilation_cache=False)
    engine = Engine(
        llm.config,
        llm.params,
        llm.mesh,
        eos_ids=llm.eos_ids,
        max_slots=slots,
        layers_per_program=layers,
        quantize=quantize,
        kv_cache_dtype=kv_cache_dtype,
    )
    timed = engine.runner.programs = TimedPrograms(engine.runner.programs)
    rng = np.random.default_rng(seed)
    if job is not None:
        lines = [json.loads(line) for line in Path(job).read_text().splitlines() if line.strip()]
        prompts = [llm.encode_chat(x["messages"]) for x in lines]
        limits = [x.get("max_tokens", max_tokens) for x in lines]
        label = f"{len(lines)} requests of {job}"
    else:
        prompts = [rng.integers(3, llm.config.vocab_size, prompt).tolist() for _ in range(requests)]
        limits = [max_tokens] * len(prompts)
        label = f"{requests} requests x {prompt} prompt tokens, max_tokens {max_tokens}"

    def job_requests():  # longest first, as `jaxllama run` submits them
        return [
            Request(i, ids, SamplingParams(max_tokens=n, temperature=0.0), priority=n)
            for i, (ids, n) in enumerate(zip(prompts, limits, strict=True))
        ]

    first = time.perf_counter()
    for _ in engine.generate(job_requests()):  # compiles every program the timed run uses
        pass
    first = time.perf_counter() - first
    compile_s, generated = engine.stats.compile_s, engine.stats.generated_tokens
    compiles = dict(timed.compiles)
    timed.times.clear()
    timed.calls.clear()
    engine.prefixes.truncate(0)  # the timed run computes every prompt, as a fresh process would
    start = time.perf_counter()
    for _ in engine.generate(job_requests()):
        pass
    wall = time.perf_counter() - start
    tokens = engine.stats.generated_tokens - generated
    print(f"{label}, {slots} slots: {wall:.1f} s, {tokens} tokens, {tokens / wall:.1f} tok/s")
    print(f"first run: {first:.1f} s, of which compile {compile_s:.1f} s ({layers} layers per program)")
    print(f"{'program (layers: rows x tokens /positions)':<46}{'calls':>7}{'s':>9}{'ms/call':>10}{'compile s':>11}")
    for kind in sorted(set(timed.times) | set(compiles)):
        calls, seconds = timed.calls[kind], timed.times.get(kind, 0.0)
        per_call = f"{1e3 * seconds / calls:>10.1f}" if calls else f"{'-':>10}"
        print(f"{kind:<46}{calls:>7}{seconds:>9.2f}{per_call}{compiles.get(kind, 0):>11.2f}")


if __name__ == "__main__":
    fire.Fire(main)
