"""Where an engine step's time goes: each compiled program's calls timed alone.

    python -m benchmarks.step_profile [--requests 32] [--prompt 40] [--max-tokens 64] [--slots 32]

Runs the engine on the default model (SmolLM2-135M-Instruct, float32) over random prompts twice: once to
compile, once timed, with every program call waited for (so the sum is a little above an unsynchronized
run's wall time). Prints calls, total seconds and milliseconds per call for each kind of program
(`engine/step.py`), and the compile time of the first run.
"""

from __future__ import annotations

import collections
import time

import fire
import jax
import numpy as np

from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.config import ModelConfig
from jaxllama.core.sharding import make_mesh
from jaxllama.default_model import default_checkpoint
from jaxllama.engine.engine import Engine, Request
from jaxllama.engine.sampling import SamplingParams


class TimedEngine(Engine):
    """An engine whose program calls wait for their results and add their time to `times[kind]`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.times, self.calls = collections.defaultdict(float), collections.Counter()

    def _run(self, kind, fn, args, static_key=None, donate=None, out=None):
        compiling, start = self.stats.compile_s, time.perf_counter()
        result = jax.block_until_ready(super()._run(kind, fn, args, static_key, donate, out))
        self.times[kind] += time.perf_counter() - start - (self.stats.compile_s - compiling)
        self.calls[kind] += 1
        return result


def main(requests: int = 32, prompt: int = 40, max_tokens: int = 64, slots: int = 32, seed: int = 0):
    path = default_checkpoint()
    mesh = make_mesh(ModelConfig.load(path), "data=1,model=1", jax.devices()[:1])
    config, params = load_checkpoint(path, mesh=mesh)
    engine = TimedEngine(config, params, mesh, max_slots=slots)
    rng = np.random.default_rng(seed)

    def job():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return [Request(i, rng.integers(3, config.vocab_size, prompt).tolist(), params) for i in range(requests)]

    for _ in engine.generate(job()):  # compiles every program the timed run uses
        pass
    compile_s = engine.stats.compile_s
    engine.times.clear()
    engine.calls.clear()
    start = time.perf_counter()
    for _ in engine.generate(job()):
        pass
    wall = time.perf_counter() - start
    print(f"{requests} requests x {prompt} prompt tokens, max_tokens {max_tokens}, {slots} slots: {wall:.1f} s")
    print(f"compile (first run): {compile_s:.1f} s")
    print(f"{'program':<16}{'calls':>7}{'s':>9}{'ms/call':>10}")
    for kind, seconds in engine.times.items():
        print(f"{kind:<16}{engine.calls[kind]:>7}{seconds:>9.2f}{1e3 * seconds / engine.calls[kind]:>10.1f}")


if __name__ == "__main__":
    fire.Fire(main)
