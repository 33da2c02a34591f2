"""A job as replicas on a local Ray cluster (two CPU cores): the records one process writes, a replica's process
killed mid-job, the driver killed and run again, a line that kills every replica it reaches, `--ray` without Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxllama.batch.dispatch import MAX_TRIES, Dispatcher
from jaxllama.batch.jobs import read_line
from jaxllama.batch.runner import Answered, JobOptions
from jaxllama.engine.options import EngineOptions
from tests.batch.test_run import finished_ids, read, wait_for_lines, without_timings, write_job
from tests.helpers.cli import jaxllama, jaxllama_here
from tests.multiprocess import REPO

ray = pytest.importorskip("ray")

LINES = [
    {"id": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0},
    {"id": "plain", "prompt": "the cat", "max_tokens": 5, "temperature": 0},
    {"id": "seeded", "prompt": "once upon", "max_tokens": 8, "temperature": 0.9, "seed": 7},
    {"id": "two", "prompt": "in the", "max_tokens": 4, "temperature": 0.8, "seed": 2, "n": 2},
    {"id": "bad", "prompt": "x", "max_tokens": -1},
    *({"id": f"r{i}", "prompt": f"count {i} and", "max_tokens": 3 + i % 5, "temperature": 0} for i in range(11)),
]


def long_job(path: Path, lines: int = 24) -> Path:
    """Lines long enough that a signal sent once a few are done arrives long before the job could end."""
    return write_job(
        path,
        [
            {"id": f"r{i}", "prompt": f"the {i}", "max_tokens": 100 + 4 * i, "ignore_eos": True, "temperature": 0}
            for i in range(lines)
        ],
    )


def start(job: Path, model: Path, *args) -> subprocess.Popen:
    """`jaxllama run --ray local` in a session of its own: killing its group takes the Ray cluster it started."""
    env = {**os.environ, "JAXLLAMA_CACHE": os.environ.get("JAXLLAMA_TEST_CACHE", "")}
    env = {k: v for k, v in env.items() if v != ""}
    command = [sys.executable, "-m", "jaxllama.cli", "run", str(job), "--model", str(model), "--ray", "local", *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def replica_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "ray::Replica"], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def answers(records: list[dict]) -> list[dict]:
    """The records less what depends on the process that answered: timings, and the prompt tokens its cache held."""
    out = without_timings(records)
    for r in out:
        if "usage" in r:
            r["usage"] = {k: v for k, v in r["usage"].items() if k != "prompt_tokens_details"}
    return out


# The driver's choices alone: no Ray, no engine.


def lines_of(objs) -> list:
    return [read_line(json.dumps(o), i + 1) for i, o in enumerate(objs)]


def dispatcher(lines, block_lines: int) -> Dispatcher:
    d = Dispatcher(block_lines)
    d.add(lines)
    d.close()
    return d


def test_lines_that_start_alike_go_out_together_and_to_the_replica_that_took_their_kind():
    shots = ["Q: 2+2? A: 4. " * 40, "Translate to French: " * 30]
    lines = lines_of({"prompt": shots[i % 2] + str(i)} for i in range(16))
    d = dispatcher(lines, block_lines=4)
    first, second = d.next_block("a", busy=False), d.next_block("b", busy=False)
    assert {line.obj["prompt"][:20] for line in first} == {shots[0][:20]}
    assert {line.obj["prompt"][:20] for line in second} == {shots[1][:20]}
    assert d.next_block("b", busy=True)[0].obj["prompt"].startswith(shots[1][:20])  # b's kind, though a's is first
    assert d.next_block("a", busy=True)[0].obj["prompt"].startswith(shots[0][:20])


def test_a_dead_replicas_lines_are_offered_again_then_alone_then_answered_with_an_error():
    lines = lines_of({"prompt": f"p{i}"} for i in range(3))
    d = dispatcher(lines, block_lines=3)
    block = d.next_block("a", busy=False)
    assert d.lost("a", block) == [] and d.next_block("b", busy=False) == block  # offered again, whole
    assert d.lost("b", block) == []  # twice lost: each line now runs alone, on a replica with nothing in flight
    assert d.next_block("a", busy=True) is None
    alone = d.next_block("a", busy=False)
    assert len(alone) == 1 and d.next_block("a", busy=False) is None  # nothing else beside it
    d.done("a", [Answered(alone[0].number, {}, True)])
    poison = d.next_block("a", busy=False)
    (failed,) = d.lost("a", poison)
    assert d.tries[poison[0].number] == MAX_TRIES and failed.record["error"]["code"] == "replica_lost"
    assert not d.finished and len(d.next_block("b", busy=False)) == 1


# On a local Ray cluster.


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_two_replicas_write_the_records_one_process_writes(cluster, tiny_chat_checkpoint, tmp_path):
    from jaxllama.batch.settings import job_settings
    from jaxllama.engine.request import SamplingParams
    from jaxllama.ray import ReplicaSpec, run_job_on_ray

    job = write_job(tmp_path / "job.jsonl", LINES)
    one = jaxllama("run", job, "--model", tiny_chat_checkpoint, "--max-batch", "4", "--output", tmp_path / "one.jsonl")
    assert one.returncode == 1  # the bad line
    spec = ReplicaSpec(str(tiny_chat_checkpoint), EngineOptions(max_slots=4))
    settings = job_settings(str(tiny_chat_checkpoint), SamplingParams(), [], None)
    stats, summary = run_job_on_ray(
        job, tmp_path / "two.jsonl", JobOptions(quiet=True, settings=settings), spec, 2, None, block_lines=2
    )
    assert answers(read(tmp_path / "two.jsonl")) == answers(read(tmp_path / "one.jsonl"))
    assert (stats.ok, stats.failed) == (len(LINES) - 1, 1)
    replicas = summary["replicas"]
    assert len(replicas) == 2 and sum(r["lines"] for r in replicas) == len(LINES)  # a replica checks each line
    assert all(r["lines"] > 0 and r["restarts"] == 0 and r["devices"].endswith(" cpu") for r in replicas)


@pytest.mark.slow
def test_a_line_that_kills_every_replica_it_reaches_becomes_an_error_record(cluster, tiny_chat_checkpoint, tmp_path):
    import ray.cloudpickle

    from jaxllama.ray import ReplicaSpec, run_job_on_ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    lines = [{"id": f"r{i}", "prompt": f"say {i}", "max_tokens": 3, "temperature": 0} for i in range(6)]
    lines.insert(3, {"id": "poison", "prompt": "poison", "max_tokens": 3})
    job = write_job(tmp_path / "job.jsonl", lines)
    spec = ReplicaSpec(str(tiny_chat_checkpoint), EngineOptions(max_slots=4))
    stats, summary = run_job_on_ray(
        job, tmp_path / "out.jsonl", JobOptions(quiet=True), spec, 2, None, block_lines=3, replica_class=Poisoned
    )
    out = read(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == [line["id"] for line in lines]
    assert out[3]["error"]["code"] == "replica_lost" and all("text" in r for r in out[:3] + out[4:])
    assert (stats.ok, stats.failed) == (6, 1) and sum(r["restarts"] for r in summary["replicas"]) == MAX_TRIES


def _poisoned():
    from jaxllama.ray import Replica

    class Poisoned(Replica):
        """A replica whose process dies on the line that says "poison", as one hit by a fault would."""

        def answer(self, lines):
            if any(line.obj.get("prompt") == "poison" for line in lines):
                os._exit(1)
            return super().answer(lines)

    return Poisoned


Poisoned = _poisoned()


@pytest.mark.slow
def test_a_replica_killed_mid_job_loses_no_line(tiny_chat_checkpoint, tmp_path):
    job = long_job(tmp_path / "job.jsonl")
    out, stats = tmp_path / "job.out.jsonl", tmp_path / "stats.json"
    args = ("--replicas", "2", "--max-batch", "4", "--stats-file", stats)
    driver = start(job, tiny_chat_checkpoint, *args)
    wait_for_lines(out, 3)
    (victim, *_) = replica_pids()
    os.kill(victim, signal.SIGKILL)
    _, err = driver.communicate(timeout=600)
    assert driver.returncode == 0, err[-3000:]
    assert [r["id"] for r in read(out)] == [f"r{i}" for i in range(24)]
    assert all(r["usage"]["completion_tokens"] == 100 + 4 * i for i, r in enumerate(read(out)))
    assert sum(r["restarts"] for r in json.loads(stats.read_text())["replicas"]) == 1


@pytest.mark.slow
def test_the_driver_killed_and_run_again_resumes(tiny_chat_checkpoint, tmp_path):
    job = long_job(tmp_path / "job.jsonl")
    out = tmp_path / "job.out.jsonl"
    driver = start(job, tiny_chat_checkpoint, "--replicas", "2", "--max-batch", "4")
    wait_for_lines(out, 3)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver's host lost: its Ray cluster with it
    driver.wait()
    before = finished_ids(out)
    assert 3 <= len(before) < 24
    deadline = time.time() + 60
    while replica_pids() and time.time() < deadline:
        time.sleep(0.5)
    again = start(job, tiny_chat_checkpoint, "--replicas", "2", "--max-batch", "4")
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    assert "already done" in err
    assert [r["id"] for r in read(out)] == [f"r{i}" for i in range(24)]


def test_ray_without_its_extra_is_refused_naming_the_extra(tiny_chat_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    job = write_job(tmp_path / "job.jsonl", LINES[:1])
    done = jaxllama_here("run", job, "--model", tiny_chat_checkpoint, "--ray", "local")
    assert done.returncode == 2 and "pip install -e '.[ray]'" in done.stderr
    assert not (tmp_path / "job.out.jsonl").exists()


@pytest.mark.slow
def test_ray_datas_map_batches_answers_rows_as_a_job_answers_lines(cluster, tiny_chat_checkpoint, tmp_path):
    import ray.data

    from jaxllama.ray import Answerer

    rows = [{k: v for k, v in line.items() if k != "n"} for line in LINES if line["id"] not in ("bad", "chat")]
    rows.append({"id": "bad", "prompt": "x", "max_tokens": -1})
    job = write_job(tmp_path / "job.jsonl", rows)
    assert jaxllama("run", job, "--model", tiny_chat_checkpoint, "--max-batch", "4").returncode == 1  # the bad line
    expected = {r["id"]: r for r in read(tmp_path / "job.out.jsonl")}
    answers = (
        ray.data.from_items(rows)
        .map_batches(
            Answerer,
            fn_constructor_kwargs={"model": str(tiny_chat_checkpoint), "options": EngineOptions(max_slots=4)},
            concurrency=1,
            batch_size=4,
            batch_format="pyarrow",
        )
        .take_all()
    )
    assert sorted(a["id"] for a in answers) == sorted(r["id"] for r in rows)
    for a in answers:
        want = expected[a["id"]]
        if a["id"] == "bad":
            assert a["answer"] is None and a["error"] == want["error"]["message"]
        else:
            assert (a["answer"], a["finish_reason"], a["error"]) == (want["text"], want["finish_reason"], None)
            assert a["completion_tokens"] == want["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    "flags, said",
    [
        (("--replicas", "0"), "--replicas 0: must be a whole number"),
        (("--replica-processes", "0"), "--replica-processes 0: must be a whole number"),
        (("--coordinator", "127.0.0.1:1"), "--replica-processes N"),
    ],
)
def test_a_ray_flag_that_cannot_work_is_refused_before_anything_starts(tiny_chat_checkpoint, tmp_path, flags, said):
    job = write_job(tmp_path / "job.jsonl", LINES[:1])
    done = jaxllama_here("run", job, "--model", tiny_chat_checkpoint, "--ray", "local", *flags)
    assert done.returncode == 2 and said in done.stderr
    assert not (tmp_path / "job.out.jsonl").exists()
