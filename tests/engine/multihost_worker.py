"""One process of the multi-process engine test (tests/engine/test_multihost.py), and the cases it runs.

    python -m tests.engine.multihost_worker COORDINATOR NUM_PROCESSES PROCESS_ID DIR

joins the run, runs every case of `CASES` on a mesh over all processes' devices, with the parameters the
test wrote to DIR/CASE.pkl, and writes the tokens each request got, as this process saw them, to
DIR/processI.json. The test runs the same cases in one process and compares.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import jax
import numpy as np

from jaxllama.core.params import param_shardings
from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.request import Request, SamplingParams
from tests.helpers.engine import EOS, random_prompts, tiny_config

# name: (config overrides, mesh, decode steps). The data axis across the processes, the model axis within each,
# with fewer KV heads than the model axis (replicated). tests/batch/test_run_multihost.py puts the model axis
# across the processes.
CASES = {
    "kv1-data2-model2": (dict(n_kv_heads=1), "data=2,model=2", 3),
}


def case_config(name: str):
    return tiny_config(**CASES[name][0])


def requests() -> list[Request]:
    """Two greedy requests, one sampled with a seed, one sampled without (which can only be compared across
    processes). All fit the engine's 4 slots and the sampled ones run longest, so that each case compiles
    one prefill and one decode program."""
    prompts = random_prompts(2, seed=3, max_len=16)
    return [
        Request("greedy-0", prompts[0], SamplingParams(max_tokens=5, temperature=0.0)),
        Request("greedy-1", prompts[1], SamplingParams(max_tokens=9, temperature=0.0)),
        Request("seeded", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.9, seed=7)),
        Request("unseeded", [8, 9], SamplingParams(max_tokens=12, temperature=0.9)),
    ]


def place(params, config, mesh):
    """Host params (the same on every process) onto the mesh, each process filling only its own devices."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
        jax.tree.map(np.asarray, params),
        param_shardings(config, mesh),
    )


def run_case(name: str, params, devices) -> dict[str, list[int]]:
    """{request id: generated tokens} for every request of `requests()`."""
    _, spec, steps = CASES[name]
    config = case_config(name)
    mesh = make_mesh(config, spec, devices)
    engine = Engine(config, place(params, config, mesh), mesh, eos_ids=[EOS], max_slots=4, decode_steps=steps)
    tokens = {}
    for u in engine.generate(requests()):
        tokens.setdefault(u.id, []).extend(u.tokens)
    return tokens


def main(coordinator: str, num_processes: str, process_id: str, folder: str) -> None:
    from jaxllama.engine.runtime import enable_compilation_cache, initialize_distributed

    initialize_distributed(coordinator, int(num_processes), int(process_id))
    if os.environ.get("JAXLLAMA_CACHE"):  # the test session's cache (tests/conftest.py)
        enable_compilation_cache()
    folder = Path(folder)
    cases = {}
    for name in CASES:
        params = pickle.loads((folder / f"{name}.pkl").read_bytes())
        cases[name] = run_case(name, params, jax.devices())
    result = {"process_count": jax.process_count(), "local_devices": jax.local_device_count(), "cases": cases}
    (folder / f"process{process_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
