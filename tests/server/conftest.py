"""A live OpenAI-compatible server on localhost, over the tiny chat model, shared by the server tests.

uvicorn runs in a background thread of the test process, so that tests can also look at the engine
(`live.worker`, `live.llm`) while the official `openai` client talks to it over HTTP.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest

from tests.helpers.server import CHAT, CONTEXT, MAX_QUEUE, MODEL_NAME, PROMPT, SLOTS


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
