"""`jaxllama serve` as a subprocess: it answers the openai client like the Python API, and stops cleanly on
Ctrl-C; a bad model path is a clear error."""

from __future__ import annotations

import signal

import pytest

from tests.helpers.server import CHAT, CONTEXT, SLOTS, server_process
from tests.multiprocess import free_port


def test_serve_answers_and_stops_on_ctrl_c(tiny_chat_checkpoint, reference):
    import openai

    port = free_port()
    args = ["-m", "jaxllama.cli", "serve", "--model", str(tiny_chat_checkpoint), "--port", str(port)]
    args += [
        "--max-batch",
        str(SLOTS),
        "--max-context",
        str(CONTEXT),
        "--served-model-name",
        "cli-model",
        "--max-queue",
        "4",
        "--log-level",
        "warning",
    ]
    with server_process(args, port) as proc:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["cli-model"]
        r = client.chat.completions.create(model="cli-model", messages=CHAT, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == reference["chat"].text and r.model == "cli-model"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_serve_with_a_missing_model_is_a_clear_error(tmp_path, capsys):
    from jaxllama.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(tmp_path / "missing")])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: ")
