"""`jaxllama run` on 2 processes x 2 CPU devices over gloo writes the output file one process writes (timings
aside), with only process 0 writing, resuming from the same partial output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import LOCAL_DEVICES, REPO, free_port, process_env, run_processes

PROCESSES = 2
MESH = "data=1,model=4"  # the model axis across the processes; 2 KV heads, replicated
JOB = [
    {"id": "chat", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "temperature": 0},
    {"id": "plain", "prompt": "the cat", "max_tokens": 8, "temperature": 0},
    {"id": "seeded", "prompt": "in the", "max_tokens": 6, "temperature": 0.8, "seed": 3},
    {
        "id": "multi-turn",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "the"},
            {"role": "user", "content": "then?"},
        ],
        "max_tokens": 7,
        "temperature": 0,
    },
    {"id": "stop", "prompt": "the the", "max_tokens": 10, "temperature": 0, "stop": ["e"]},
]
DONE = 2  # lines already in the output when the two processes start


def without_timings(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "timings"} for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_write_what_one_process_writes(tiny_chat_checkpoint, tmp_path):
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in JOB))
    model = ["--model", str(tiny_chat_checkpoint), "--mesh", MESH]
    command = [sys.executable, "-m", "jaxllama.cli", "run", str(job), *model]

    single = tmp_path / "single.out.jsonl"
    env = process_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={PROCESSES * LOCAL_DEVICES}")
    proc = subprocess.run(
        [*command, "--output", str(single)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    expected = without_timings(single)
    assert [r["id"] for r in expected] == [line["id"] for line in JOB]

    out = tmp_path / "multi.out.jsonl"
    out.write_text("".join(single.read_text().splitlines(keepends=True)[:DONE]) + '{"id": "stop", "te')  # cut line
    coordinator = f"127.0.0.1:{free_port()}"
    multihost = ["--output", str(out), "--coordinator", coordinator, "--num-processes", str(PROCESSES)]
    logs = run_processes(
        [[*command, *multihost, "--process-id", str(i)] for i in range(PROCESSES)], tmp_path / "logs", timeout=300
    )
    assert without_timings(out) == expected  # nothing lost, nothing written twice
    assert f"{DONE} already done" in logs[0] and f"wrote {out}" in logs[0]
    assert "host 1:" in logs[0]  # the per-host summary gathered across processes
    assert "wrote" not in logs[1] and "requests:" not in logs[1]
