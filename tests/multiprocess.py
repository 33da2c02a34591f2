"""Start a multi-process JAX run on this machine: a free coordinator port, N processes with 2 virtual CPU
devices each, a deadline, and every process killed if one fails or the deadline passes (no hung test)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL_DEVICES = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(**extra: str) -> dict[str, str]:
    """The environment of a process with LOCAL_DEVICES CPU devices, sharing the test session's compilation
    cache (see conftest.py)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
        "JAX_PLATFORMS": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
        "JAXLLAMA_CACHE": os.environ.get("JAXLLAMA_TEST_CACHE", ""),
        **extra,
    }
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return {k: v for k, v in env.items() if v != ""}


def run_processes(commands: list[list[str]], logs: Path, timeout: float, env: dict | None = None) -> list[str]:
    """Run the commands at once (one per process) and return their outputs (stdout and stderr); fail the test,
    after killing every process still running, when one exits non-zero or the deadline passes."""
    import pytest

    logs.mkdir(parents=True, exist_ok=True)
    env = env or process_env()
    procs, files = [], []
    try:
        for i, cmd in enumerate(commands):
            out = open(logs / f"process{i}.log", "w+")
            files.append(out)
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        report = "\n".join(
            f"--- process {i} (exit {c}) ---\n{t[-4000:]}" for i, (c, t) in enumerate(zip(codes, texts, strict=True))
        )
        pytest.fail(f"multi-process run failed or timed out after {timeout:.0f} s:\n{report}")
    return texts
