"""examples/litserve_server.py answers a real request: LitServe's worker loads the model with `LLM.load` and
`predict` calls `generate`; the answer is the Python API's."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server import PROMPT, server_process
from tests.multiprocess import free_port


@pytest.mark.slow
def test_litserve_example_answers(tiny_chat_checkpoint, reference):
    port = free_port()
    args = ["examples/litserve_server.py", "--model", str(tiny_chat_checkpoint), "--port", str(port)]
    with server_process(args, port):
        url = f"http://127.0.0.1:{port}/predict"
        r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        ref = reference["text"]
        assert r.json() == {"output": ref.text, "finish_reason": ref.finish_reason, "usage": ref.usage}
        bad = httpx.post(url, json={"prompt": PROMPT, "top_p": 3}, timeout=60)
        assert bad.status_code == 400 and "top_p" in bad.json()["detail"]
