"""A replica over several processes on a local Ray cluster: two replicas, each one jax.distributed group of two CPU
processes (a device each, the mesh across them), as a replica over a TPU slice's hosts would be; one process of one
group dies mid-job. The records are those of one process running the same mesh."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jaxllama.batch.runner import JobOptions
from jaxllama.engine.options import EngineOptions
from tests.batch.test_ray import LINES, answers
from tests.batch.test_run import read, write_job
from tests.helpers.cli import jaxllama

ray = pytest.importorskip("ray")

MESH = "data=1,model=2"
ONE_DEVICE = "--xla_force_host_platform_device_count=1"


@pytest.fixture(scope="module")
def cluster():
    # Four processes on two cores: logical cores enough for each to hold one; a device each.
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"XLA_FLAGS": ONE_DEVICE}})
    yield
    ray.shutdown()


def _follower_dies_once():
    from jaxllama.ray import Replica

    class FollowerDiesOnce(Replica):
        """A replica whose process 1 dies on the block holding the line "r3", the first time only (a file remembers):
        its group is lost with it, and the line is answered by a group started again."""

        def answer(self, lines):
            marker = Path(self.options.settings["marker"])
            if self.rank == 1 and any(line.id == "r3" for line in lines) and not marker.exists():
                marker.touch()
                os._exit(1)
            return super().answer(lines)

    return FollowerDiesOnce


FollowerDiesOnce = _follower_dies_once()


@pytest.mark.slow
def test_replicas_over_two_processes_each_write_what_one_process_writes(cluster, tiny_chat_checkpoint, tmp_path):
    import ray.cloudpickle

    from jaxllama.ray import ReplicaSpec, run_job_on_ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    job = write_job(tmp_path / "job.jsonl", LINES)
    flags = ("--max-batch", "4", "--mesh", MESH, "--output", tmp_path / "one.jsonl")
    two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert jaxllama("run", job, "--model", tiny_chat_checkpoint, *flags, env=two_devices).returncode == 1  # "bad"

    spec = ReplicaSpec(str(tiny_chat_checkpoint), EngineOptions(max_slots=4), mesh=MESH, processes=2)
    options = JobOptions(quiet=True, settings={"marker": str(tmp_path / "died")})
    stats, summary = run_job_on_ray(
        job, tmp_path / "two.jsonl", options, spec, 2, None, block_lines=4, replica_class=FollowerDiesOnce
    )
    assert (tmp_path / "died").exists()  # a follower did die
    assert answers(read(tmp_path / "two.jsonl")) == answers(read(tmp_path / "one.jsonl"))
    assert (stats.ok, stats.failed) == (len(LINES) - 1, 1)
    replicas = summary["replicas"]
    assert sum(r["restarts"] for r in replicas) == 1
    assert all(r["devices"] == "2 cpu over 2 processes" for r in replicas)
