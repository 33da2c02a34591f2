"""A live OpenAI-compatible server on localhost, over the tiny chat model, shared by the server tests.

uvicorn runs in a background thread of the test process, so that tests can also look at the engine
(`live.worker`, `live.llm`) while the official `openai` client talks to it over HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

# The engine's shape: 8 decode slots (one per virtual CPU device) and a 64-token context, so that one cache size
# serves every test, and the subprocess tests (`jaxllama serve`, the LitServe example) and the README tests load
# the same compiled programs from the session's compilation cache.
SLOTS = 8
CONTEXT = 64
MAX_QUEUE = 8  # requests waiting for a slot at most: with every slot busy and 8 waiting, one more gets 429
MODEL_NAME = "tiny-chat"


@dataclasses.dataclass
class Live:
    url: str  # http://127.0.0.1:PORT
    app: object
    llm: object

    @property
    def worker(self):
        return self.app.state.worker

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)


@pytest.fixture(scope="session")
def tiny_llm(tiny_chat_checkpoint):
    from jaxllama.llm import LLM

    # compilation_cache=False: keep the test session's cache (tests/conftest.py) rather than the user's.
    return LLM.load(tiny_chat_checkpoint, max_slots=SLOTS, max_context=CONTEXT, compilation_cache=False)


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
PROMPT = "the cat sat on the mat, and then the dog came in"  # 36 tokens; CHAT is 44: one prefill size (48)


@pytest.fixture(scope="session")
def reference(tiny_llm) -> dict:
    """Greedy answers of the Python API (`LLM.chat`, `LLM.generate`), computed before the server's engine thread
    takes the engine over: what the server must answer to the same requests."""
    return {
        "chat": tiny_llm.chat(CHAT, max_tokens=12, temperature=0, logprobs=True),
        "text": tiny_llm.generate(PROMPT, max_tokens=12, temperature=0, logprobs=True),
    }


@pytest.fixture(scope="session")
def live(tiny_llm, reference):
    """The server, started once per session (after `reference`: from then on only the server's engine thread
    uses the engine); stopped, its engine thread joined, at the end."""
    import uvicorn

    from jaxllama.server.app import create_app

    app = create_app(tiny_llm, model_name=MODEL_NAME, max_queue=MAX_QUEUE, max_tokens=16)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the server did not start")
        time.sleep(0.05)
    yield Live(f"http://127.0.0.1:{port}", app, tiny_llm)
    server.should_exit = True
    thread.join(30)
    sock.close()


def wait_until(condition, timeout: float = 30, what: str = "condition"):
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
