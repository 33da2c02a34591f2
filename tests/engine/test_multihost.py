"""The engine across 2 processes x 2 CPU devices over gloo (tests/engine/multihost_worker.py): both processes
see the same tokens, the same as one process on the same mesh, and greedy ones as the full-forward reference."""

from __future__ import annotations

import json
import pickle
import sys

import jax
import numpy as np
import pytest

from tests.engine.multihost_worker import CASES, case_config, requests, run_case
from tests.helpers.engine import EOS, reference_greedy, spread_params
from tests.multiprocess import free_port, run_processes

PROCESSES = 2


@pytest.fixture(scope="module")
def params():
    return {name: jax.tree.map(np.asarray, spread_params(case_config(name))) for name in CASES}


@pytest.fixture(scope="module")
def per_process(params, tmp_path_factory) -> list[dict]:
    """What each process of a 2-process run saw."""
    folder = tmp_path_factory.mktemp("multihost")
    for name, p in params.items():
        (folder / f"{name}.pkl").write_bytes(pickle.dumps(p))
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [
        [sys.executable, "-m", "tests.engine.multihost_worker", coordinator, str(PROCESSES), str(i), str(folder)]
        for i in range(PROCESSES)
    ]
    run_processes(commands, folder / "logs", timeout=300)
    return [json.loads((folder / f"process{i}.json").read_text()) for i in range(PROCESSES)]


@pytest.mark.slow
def test_every_process_sees_the_same_tokens(per_process):
    first = per_process[0]
    assert first["process_count"] == PROCESSES and first["local_devices"] == 2
    for other in per_process[1:]:
        assert other["cases"] == first["cases"]  # the unseeded request too: its seed is agreed on


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_same_tokens_as_one_process(per_process, params, name):
    config = case_config(name)
    single = run_case(name, params[name], jax.devices()[:4])
    multi = per_process[0]["cases"][name]
    assert set(multi) == {r.id for r in requests()}
    assert {k: v for k, v in multi.items() if k != "unseeded"} == {k: v for k, v in single.items() if k != "unseeded"}
    for r in requests():
        if r.params.temperature == 0:
            assert multi[r.id] == reference_greedy(config, params[name], r.prompt, r.params.max_tokens, eos=(EOS,))
