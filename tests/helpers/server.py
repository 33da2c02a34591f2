"""The tiny chat model's server set-up that the server tests share: the engine's shape, the requests, and a server
run as a command in its own process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.multiprocess import REPO

# The engine's shape: 8 decode slots (one per virtual CPU device) and a 64-token context, so that one cache size
# serves every test, and the subprocess tests (`jaxllama serve`, the LitServe example) and the README tests load
# the same compiled programs from the session's compilation cache.
SLOTS = 8
CONTEXT = 64
MAX_QUEUE = 8  # requests waiting for a slot at most: with every slot busy and 8 waiting, one more gets 429
MODEL_NAME = "tiny-chat"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
PROMPT = "the cat sat on the mat, and then the dog came in"  # 36 tokens; CHAT is 44: one prefill size (48)


def wait_until(condition, timeout: float = 30, what: str = "condition"):
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def server_process(args: list[str], port: int, timeout: float = 120):
    """Run a server command (in its own process group, sharing the session's compilation cache, its output in a
    file) until GET /health answers 200; yield the process; then stop the whole group (LitServe leaves workers
    behind)."""
    env = {**os.environ, "JAXLLAMA_CACHE": os.environ.get("JAXLLAMA_TEST_CACHE", "")}
    env = {k: v for k, v in env.items() if v != ""}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

        def output() -> str:
            log.seek(0)
            return log.read()

        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"the server exited ({proc.returncode}):\n{output()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer /health within {timeout} s:\n{output()}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
