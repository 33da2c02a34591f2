"""`jaxllama run` as a subprocess on a tiny converted chat model: input shapes, order, errors, resume. A command it
refuses before the model loads runs in this process (`jaxllama_here`): nothing there needs a process of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxllama.batch import records
from tests.helpers.cli import jaxllama, jaxllama_here

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_chat(tiny_chat_checkpoint) -> Path:
    """The session's tiny chat model (tests/conftest.py)."""
    return tiny_chat_checkpoint


def write_job(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


GOOD = [
    {
        "id": "chat",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        "max_tokens": 6,
        "temperature": 0,
    },
    {"id": "plain", "prompt": "the cat", "max_tokens": 5, "temperature": 0},
    {
        "custom_id": "oa-chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "temperature": 0},
    },
    {
        "custom_id": "oa-text",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "in the", "max_tokens": 3, "temperature": 0},
    },
    {"messages": [{"role": "user", "content": "no id here"}], "max_tokens": 2, "temperature": 0.7, "seed": 3},
]
BAD = [
    "{not json",
    {"id": "role", "messages": [{"role": "robot", "content": "x"}]},
    {"id": "long", "prompt": "the " * 400, "max_tokens": 4},
    {"id": "param", "prompt": "x", "top_p": 1.5},
    {"id": "shape", "text": "neither messages nor prompt"},
    {"custom_id": "oa-bad", "method": "POST", "url": "/v1/embeddings", "body": {}},
]


@pytest.mark.slow
def test_every_shape_in_order_with_error_records(tiny_chat, tmp_path):
    job = write_job(
        tmp_path / "job.jsonl",
        [GOOD[0], BAD[0], GOOD[1], BAD[1], GOOD[2], BAD[2], GOOD[3], BAD[3], GOOD[4], BAD[4], BAD[5]],
    )
    proc = jaxllama("run", job, "--model", tiny_chat, "--stats-file", tmp_path / "stats.json")
    assert proc.returncode == 1, proc.stderr  # some lines failed
    out = read(tmp_path / "job.out.jsonl")
    assert [r.get("custom_id", r.get("id")) for r in out] == [
        "chat",
        2,
        "plain",
        "role",
        "oa-chat",
        "long",
        "oa-text",
        "param",
        9,
        "shape",
        "oa-bad",
    ]
    chat, bad_json, plain, role, oa_chat, long, oa_text, param, no_id, shape, oa_bad = out
    assert chat["message"]["role"] == "assistant" and isinstance(chat["message"]["content"], str)
    assert chat["usage"]["completion_tokens"] <= 6 and chat["finish_reason"] in ("stop", "length")
    assert set(chat["timings"]) == {"queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "decode_tokens_per_s", "total_ms"}
    assert isinstance(plain["text"], str) and plain["usage"]["completion_tokens"] <= 5
    body = oa_chat["response"]["body"]
    assert oa_chat["response"]["status_code"] == 200 and oa_chat["error"] is None
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 4
    assert oa_text["response"]["body"]["object"] == "text_completion"
    assert "message" in no_id
    assert bad_json["error"]["code"] == "invalid_json" and bad_json["error"]["line"] == 2
    assert role["error"]["code"] == "invalid_messages" and "robot" in role["error"]["message"]
    assert long["error"]["code"] == "context_length_exceeded"
    assert param["error"]["code"] == "invalid_parameter" and "top_p" in param["error"]["message"]
    assert shape["error"]["code"] == "invalid_request"
    assert oa_bad["response"]["status_code"] == 400 and "embeddings" in oa_bad["response"]["body"]["error"]["message"]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["ok"] == 5 and stats["failed"] == 6 and stats["completion_tokens"] > 0
    # a slot per line (rounded up to a multiple of the mesh's data axis), not --max-batch's 64: each is allocated
    assert 11 <= stats["slots"] < 64
    assert "requests: 5 ok, 6 failed" in proc.stderr


@pytest.mark.slow
def test_stop_strings_and_per_line_parameters(tiny_chat, tmp_path):
    base = write_job(tmp_path / "base.jsonl", [{"id": "x", "prompt": "the cat", "max_tokens": 12, "temperature": 0}])
    assert jaxllama("run", base, "--model", tiny_chat).returncode == 0
    text = read(tmp_path / "base.out.jsonl")[0]["text"]
    assert len(text) >= 4
    stop = text[2:4]
    job = write_job(
        tmp_path / "stop.jsonl",
        [
            {"id": "s", "prompt": "the cat", "max_tokens": 12, "temperature": 0, "stop": [stop]},
            {"id": "t", "prompt": "the cat", "max_tokens": 3, "temperature": 0},
        ],
    )
    assert jaxllama("run", job, "--model", tiny_chat, "--max-tokens", "12").returncode == 0
    s, t = read(tmp_path / "stop.out.jsonl")
    assert s["text"] == text[: text.index(stop)] and stop not in s["text"]
    assert (s["finish_reason"], s["stop_reason"]) == ("stop", stop)
    assert t["usage"]["completion_tokens"] == 3 and t["finish_reason"] == "length"


def start_job(job: Path, model: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "JAXLLAMA_CACHE": os.environ.get("JAXLLAMA_TEST_CACHE", "")}
    env = {k: v for k, v in env.items() if v != ""}
    command = [sys.executable, "-m", "jaxllama.cli", "run", str(job), "--model", str(model), *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def finished_ids(out: Path) -> set[str]:
    """The ids of the whole records in a job's output and its journal (a resumed run rewrites the journal, so its
    length alone does not count the lines done)."""
    ids = set()
    for path in (out, out.with_name(out.name + ".journal")):
        for line in path.read_text().splitlines() if path.exists() else ():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                pass
    return ids


def wait_for_lines(out: Path, n: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and len(finished_ids(out)) < n:
        time.sleep(0.01)


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "timings"} for r in records]


@pytest.mark.slow
def test_resume_after_ctrl_c_or_kill_loses_and_duplicates_nothing(tiny_chat, tmp_path):
    # max_tokens growing along the job: longest first runs the last lines first, so that finished lines wait in
    # the journal, not yet in the output. Every line runs to its max_tokens: when the third is done, seven eighths of
    # the job's decode steps are still to run (over a thousand), so that on any machine the signal, sent within a
    # poll of the journal, arrives long before the job could end.
    lines = [
        {"id": f"r{i}", "prompt": f"the {i}", "max_tokens": 100 + 4 * i, "ignore_eos": True, "temperature": 0}
        for i in range(24)
    ]
    job = write_job(tmp_path / "job.jsonl", lines)
    out, journal = tmp_path / "job.out.jsonl", tmp_path / "job.out.jsonl.journal"
    proc = start_job(job, tiny_chat, "--max-batch", "2", "--quiet")
    wait_for_lines(out, 3)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, f"{len(finished_ids(out))} of 24 lines done before the signal: {stderr}"
    assert "Traceback" not in stderr and "run the same command again to resume" in stderr
    done = int(stderr.split("interrupted: ")[1].split(" of 24 lines done")[0])
    assert done >= 3 and len(read(out)) < done  # the output waits for the first lines; the journal holds the rest

    proc = start_job(job, tiny_chat, "--max-batch", "2", "--quiet")
    wait_for_lines(out, done + 3)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL and done + 3 <= len(finished_ids(out)) < len(lines)
    with open(out, "a") as f:
        f.write('{"id": "r99", "text": "trunc')  # a line cut by the kill
    with open(journal, "a") as f:
        f.write('{"id": "r98", "te')

    assert jaxllama("run", job, "--model", tiny_chat, "--max-batch", "2").returncode == 0
    resumed = read(out)
    assert [r["id"] for r in resumed] == [line["id"] for line in lines] and not journal.exists()

    again = jaxllama("run", job, "--model", tiny_chat)  # everything done: nothing runs, nothing is appended
    assert again.returncode == 0 and "24 already done" in again.stderr and read(out) == resumed
    # the same job run whole, from the start: what the interrupted runs and the resume wrote together
    whole = jaxllama("run", job, "--model", tiny_chat, "--overwrite", "--max-batch", "2")
    assert whole.returncode == 0 and "already done" not in whole.stderr and "requests: 24 ok" in whole.stderr
    assert without_timings(read(out)) == without_timings(resumed)


@pytest.mark.slow
def test_failed_lines_run_again_on_resume_and_settings_must_match(tiny_chat, tmp_path):
    bad = {"id": "b", "prompt": "the dog", "max_tokens": 4, "temperature": 0, "top_p": 1.5}
    lines = [GOOD[1], bad, {"id": "c", "prompt": "in the", "max_tokens": 3, "temperature": 0}]
    job = write_job(tmp_path / "job.jsonl", lines)
    out = tmp_path / "job.out.jsonl"
    assert jaxllama("run", job, "--model", tiny_chat).returncode == 1
    first = read(out)
    assert [r["id"] for r in first] == ["plain", "b", "c"] and first[1]["error"]["code"] == "invalid_parameter"

    kept = jaxllama("run", job, "--model", tiny_chat, "--no-retry-errors")  # nothing runs; the job still failed
    assert kept.returncode == 1 and "3 already done (1 of them failed)" in kept.stderr and read(out) == first

    write_job(job, [GOOD[1], {**bad, "top_p": 1}, lines[2]])  # the line fixed
    fixed = jaxllama("run", job, "--model", tiny_chat)
    assert fixed.returncode == 0 and "retrying 1 that failed" in fixed.stderr, fixed.stderr
    again = read(out)
    assert [r["id"] for r in again] == ["plain", "b", "c"] and again[0] == first[0] and again[2] == first[2]
    assert "text" in again[1] and again[1]["usage"]["completion_tokens"] <= 4

    for other in (["--model", tiny_chat, "--system-prompt", "be brief"], ["--model", tmp_path / "other"]):
        proc = jaxllama_here("run", job, *other)  # refused before the model loads (the other one does not exist)
        assert proc.returncode == 2 and "written with other settings" in proc.stderr and read(out) == again
    assert jaxllama("run", job, "--model", tiny_chat, "--system-prompt", "be brief", "--overwrite").returncode == 0


@pytest.mark.slow
def test_the_worst_lines_cost_only_themselves(tiny_chat, tmp_path):
    plain = {"prompt": "the cat", "max_tokens": 2, "temperature": 0}
    raw = [
        json.dumps({"id": "sep", **plain, "prompt": "a\u2028b\u2029c\u0085d"}, ensure_ascii=False).encode(),
        b"[" * 100_000,
        rb'{"id": "surrogate", "prompt": "scraped \udc00"}',
        rb'{"id": "id\udc00", "prompt": "x"}',
        rb'{"custom_id": "oa", "url": "/v1/completions", "body": {"model": "\udc00", "prompt": "x"}}',
        b'{"id": "latin-1", "prompt": "caf\xe9"}',
        json.dumps({"id": "crlf", **plain}).encode() + b"\r",
    ]
    job = tmp_path / "job.jsonl"
    job.write_bytes(b"\xef\xbb\xbf" + b"\n".join(raw) + b"\n")
    for _ in range(2):  # and again: a rerun retries the bad lines, which fail the same way
        proc = jaxllama("run", job, "--model", tiny_chat)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        out = [json.loads(x) for x in (tmp_path / "job.out.jsonl").read_text(encoding="utf-8").splitlines()]
        assert [records.record_id(r) for r in out] == ["sep", 2, "surrogate", "id\udc00", "oa", 6, "crlf"]
        assert "text" in out[0] and "text" in out[-1]
        codes = [r["error"]["code"] for r in out[1:4] + out[5:6]] + [out[4]["response"]["body"]["error"]["code"]]
        assert codes == ["invalid_json", "invalid_request", "invalid_request", "invalid_json", "invalid_request"]
        assert out[3]["error"]["message"].startswith("id: holds '\\udc00', a lone surrogate")


def test_unreadable_job_or_model_fails_at_once(tiny_chat, tmp_path):
    proc = jaxllama_here("run", tmp_path / "missing.jsonl", "--model", tiny_chat)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("missing.jsonl: no such job file")
    job = write_job(tmp_path / "job.jsonl", [GOOD[1]])
    proc = jaxllama_here("run", job, "--model", tmp_path / "nothing")
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_quantized_weights_and_a_float16_cache(tiny_chat, tmp_path):
    job = write_job(tmp_path / "job.jsonl", GOOD[:2])
    options = ("--quantize", "w8a8", "--kv-cache-dtype", "float16")
    proc = jaxllama("run", job, "--model", tiny_chat, *options, env={"XLA_FLAGS": ""})  # one device
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in read(tmp_path / "job.out.jsonl")] == ["chat", "plain"]
    proc = jaxllama("run", job, "--model", tiny_chat, "--quantize", "q8_0", "--overwrite", env={"XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stderr
    proc = jaxllama_here("run", job, "--model", tiny_chat, "--quantize", "q5_1", "--overwrite")
    assert proc.returncode == 2 and "--quantize='q5_1': expected one of int8, q8_0, w8a8, q4_0" in proc.stderr
    proc = jaxllama_here("run", job, "--model", tiny_chat, "--kv-cache-dtype", "float8", "--overwrite")
    assert proc.returncode == 2 and "--kv-cache-dtype='float8': expected auto or one of float32" in proc.stderr


def test_info(tiny_chat):
    proc = jaxllama("info", tiny_chat)
    assert proc.returncode == 0, proc.stderr
    assert "end of generation: 263 '<|im_end|>'" in proc.stdout and "parameters:" in proc.stdout


def test_help_is_readable():
    proc = jaxllama("run", "--help")
    assert "Run a JSONL job" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_second_run_on_the_same_output_is_refused_at_once(tiny_chat, tmp_path):
    """One writer per output: while a run holds it (here this process, as a run would), another is refused before its
    model loads, naming the holder (in this process too: the second run's lock is another open file's); once the
    holder is gone the output is free again."""
    from jaxllama.batch.lock import OutputLock

    job = write_job(tmp_path / "job.jsonl", GOOD[:2])
    out = tmp_path / "job.out.jsonl"
    with OutputLock(out):
        proc = jaxllama_here("run", job, "--model", tiny_chat)
        assert proc.returncode == 2 and f"another run (pid {os.getpid()}) is writing {out}" in proc.stderr
        assert "loading" not in proc.stderr and not out.exists()
    proc = jaxllama("run", job, "--model", tiny_chat)
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in read(out)] == ["chat", "plain"]
