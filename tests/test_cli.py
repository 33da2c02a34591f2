"""The `jaxllama` command's first contact: a command line it cannot take is refused before anything loads, --help and
--version answer at once (no pager), --stop reads escapes, --model takes a GGUF file or a relative path, a smaller
--mesh takes the first devices, and each slow phase of a cold start says what it is doing."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllama import __version__
from jaxllama.cli import COMMANDS, METAVARS, REPEATABLE, main, run
from jaxllama.cli_args import fire_argv, unescape, usage
from tests.factories import write_chat_gguf
from tests.helpers.cli import jaxllama, jaxllama_here
from tests.readme import README

REPO = Path(__file__).resolve().parents[1]


def test_a_mistyped_flag_is_refused_before_the_model_loads(tiny_chat_checkpoint, tmp_path, monkeypatch):
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "x", "prompt": "the cat", "max_tokens": 4}) + "\n")
    proc = jaxllama_here("run", job, "--model", tiny_chat_checkpoint, "--max-token", "8", "--temprature", "0")
    assert proc.returncode == 2 and "error: unknown flag --max-token" in proc.stderr
    assert "usage: jaxllama run JOB.jsonl [--output OUT.jsonl] [--model CKPT]" in proc.stderr
    assert not (tmp_path / "job.out.jsonl").exists()  # nothing ran
    # serve would listen on its default port without a word about --prot: here it would fail the test as it loads
    monkeypatch.setattr("jaxllama.cli._load", lambda *args, **kwargs: pytest.fail("serve loads the model"))
    proc = jaxllama_here("serve", "--model", tiny_chat_checkpoint, "--prot", "8001")
    assert proc.returncode == 2 and "error: unknown flag --prot" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["run"], "missing argument JOB"),
        (["run", "a.jsonl", "b.jsonl"], "unexpected argument 'b.jsonl'"),
        (["info", "a", "b"], "unexpected argument 'b'"),
        (["chat", "--model"], "--model needs a value"),
        (["chat", "-x"], "unknown flag -x"),
        (["run", "a.jsonl", "--max-tokens", "many"], "--max-tokens many: expected an integer"),
        (["run", "a.jsonl", "--overwrite=maybe"], "--overwrite=maybe: expected true or false"),
        (["serve", "--port", "8000", "--model", "--host", "0.0.0.0"], "--model needs a value"),
        (["launch"], "unknown command 'launch'"),
    ],
)
def test_a_command_line_the_command_cannot_take_exits_2_with_its_usage(args, message, capsys):
    # In this process: `main` refuses it before anything loads (the command itself, in a process of its own, exits 2
    # the same way in test_version).
    with pytest.raises(SystemExit) as e:
        main(args)
    stderr = capsys.readouterr().err
    assert e.value.code == 2 and stderr.strip().endswith(f"error: {message}")
    assert stderr.startswith("usage: jaxllama")


def test_both_spellings_and_every_form_of_a_flag_reach_the_command():
    argv = ["--max_tokens", "8", "--temperature=0", "--stop", "\\n", "--stop=--", "--seed", "-1", "--overwrite"]
    argv += ["--no-quiet", "--system-prompt", "True", "job.jsonl"]
    assert fire_argv(run, argv, REPEATABLE) == [
        "'job.jsonl'",
        "--max_tokens=8",
        "--temperature=0.0",
        "--stop=['\\\\n', '--']",
        "--seed=-1",
        "--overwrite=True",
        "--quiet=False",
        "--system_prompt='True'",  # fire would read a bare True as the boolean
    ]


def test_stop_escapes():
    assert unescape(r"a\nb\tc\rd\\n\u00e9\x") == "a\nb\tc\rd\\n\u00e9\\x"


def test_help_prints_without_a_pager_with_flags_as_the_readme_writes_them(tmp_path):
    marker = tmp_path / "paged"
    leader, follower = pty.openpty()  # a terminal: where fire would page its help through $PAGER
    env = {**os.environ, "PAGER": f"touch {marker}; cat"}
    command = [sys.executable, "-m", "jaxllama.cli", "run", "--help"]
    proc = subprocess.Popen(command, stdin=follower, stdout=follower, cwd=REPO, env=env)
    os.close(follower)
    chunks = []
    while True:  # read as it comes: a terminal holds little
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child is gone and the terminal closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    text = b"".join(chunks).decode()
    assert proc.wait(60) == 0 and not marker.exists()
    assert "--max-tokens 256" in text and "--max_tokens" not in text and "\\uXXXX" in text


def test_version():
    proc = jaxllama("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"jaxllama {__version__}"
    assert jaxllama("--help").returncode == 0 and jaxllama().returncode == 2


@pytest.mark.parametrize("exit_with, status, stderr", [("sys.exit(0)", 0, ""), ("sys.exit('refused')", 1, "refused")])
def test_the_program_leaves_as_a_normal_exit_would(exit_with, status, stderr, tmp_path):
    # `program` skips the interpreter's teardown (os._exit): threads at work are still waited for, exit functions
    # still run, and what was written is flushed.
    marker = tmp_path / "thread"
    script = f"""
import atexit, sys, threading, time
from pathlib import Path
from jaxllama import cli
atexit.register(lambda: print("exit function ran"))
threading.Thread(target=lambda: (time.sleep(0.5), Path({str(marker)!r}).write_text("done"))).start()
sys.stdout.write("buffered ")
cli.main = lambda: {exit_with}
cli.program()
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr.strip()) == (status, "buffered exit function ran\n", stderr)
    assert marker.read_text() == "done"


def test_a_failure_nothing_expected_has_its_own_exit_status():
    """3, not 1 (which says that lines of the job have error records): a script tells a crash from bad lines."""
    script = "from jaxllama import cli\ncli.main = lambda: 1 / 0\ncli.program()\n"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "ZeroDivisionError" in proc.stderr and "error: jaxllama failed unexpectedly" in proc.stderr


def test_the_readme_shows_each_command_as_its_help_does():
    readme = " ".join(re.sub(r"#.*", "", README.read_text()).split())
    for name, fn in COMMANDS.items():
        line = " ".join(["jaxllama", *usage(name, fn, METAVARS, REPEATABLE)])
        assert line in readme, f"README.md lacks: {line}"


@pytest.mark.slow
def test_a_gguf_model_a_relative_checkpoint_a_smaller_mesh_and_what_a_cold_start_says(tmp_path):
    """One run from a GGUF file on 2 of the 8 CPU devices, each phase said on stderr; then one with --quiet from its
    conversion named by a relative path, stopping at a --stop written with escapes."""
    gguf = write_chat_gguf(tmp_path / "tiny.gguf")
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "x", "prompt": "the cat", "max_tokens": 12, "temperature": 0}) + "\n")
    cache = tmp_path / "cache"
    mesh = ("--mesh", "data=2,model=1")
    first = jaxllama("run", job, "--model", gguf, *mesh, env={"JAXLLAMA_CACHE": str(cache)}, timeout=600)
    assert first.returncode == 0, first.stderr
    (converted,) = (cache / "models").iterdir()
    for said in (f"converting {gguf}", f"loading {converted}", "compiling the engine's programs", "2 CPU devices"):
        assert said in first.stderr, first.stderr
    text = json.loads((tmp_path / "job.out.jsonl").read_text())["text"]
    assert len(text) >= 4
    stop = "".join(f"\\u{ord(c):04x}" for c in text[2:4])

    relative = os.path.relpath(converted, REPO)
    args = ("run", job, "--model", relative, *mesh, "--stop", stop, "--overwrite", "--quiet")
    second = jaxllama(*args, env={"JAXLLAMA_CACHE": str(cache)}, timeout=600)
    assert second.returncode == 0, second.stderr
    assert not any(said in second.stderr for said in ("converting", "loading", "compiling", "requests:"))
    record = json.loads((tmp_path / "job.out.jsonl").read_text())
    assert record["text"] == text[: text.index(text[2:4])] and record["stop_reason"] == text[2:4]


def test_an_unknown_dtype_is_one_error_line_before_the_model_loads(tmp_path, capsys):
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "x", "prompt": "the cat", "max_tokens": 4}) + "\n")
    gguf = write_chat_gguf(tmp_path / "tiny.gguf")  # would be converted first, were the flags not checked before
    with pytest.raises(SystemExit) as e:
        main(["run", str(job), "--model", str(gguf), "--dtype", "foo"])
    assert (
        e.value.code == 2
        and "error: dtype='foo': expected one of bfloat16, float32, float16" in capsys.readouterr().err
    )
    assert not (tmp_path / "job.out.jsonl").exists()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-batch", "0", "--max-batch=0: must be a positive integer"),
        ("--max-context", "-1", "--max-context=-1: must be a positive integer"),
        ("--kv-cache-dtype", "float8", "--kv-cache-dtype='float8': expected auto or one of"),
    ],
)
def test_a_bad_engine_flag_is_named_as_typed_before_the_model_loads(flag, value, message, tmp_path, capsys):
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "x", "prompt": "the cat", "max_tokens": 4}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["run", str(job), "--model", str(tmp_path / "never-loaded"), flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err
