"""The README's server examples (the curl command and the openai client) run against the live server."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.readme import code_blocks

README_URL = "http://127.0.0.1:8000"


def test_openai_client_example(live, capsys):
    (block,) = code_blocks("Server", "python")
    assert README_URL in block
    exec(compile(block.replace(README_URL, live.url), "README.md (## Server)", "exec"), {})
    assert capsys.readouterr().out


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_example(live):
    curl = [b for b in code_blocks("Server", "bash") if b.startswith("curl")]
    assert len(curl) == 1 and README_URL in curl[0]
    out = subprocess.run(
        ["bash", "-c", curl[0].replace(README_URL, live.url)], capture_output=True, text=True, timeout=120
    )
    answer = json.loads(out.stdout)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] > 0
