"""`jaxllama serve` under concurrent clients: the same chat requests sent one after another, then all at
once from streaming clients, through the official `openai` client; prints both wall times and the speed-up
that continuous batching gives.

    python -m benchmarks.server_bench [JOB.jsonl] [--clients 16] [--model CKPT] [--port 8011]

JOB.jsonl: chat lines ("messages", "max_tokens"); default: the first --clients lines of jobs/eval.jsonl that
have "messages". Greedy, so both passes must give the same texts (checked).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fire
import httpx
from openai import OpenAI

REPO = Path(__file__).resolve().parents[1]


def _requests(job: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in job.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "messages" in r][:n]
    return [{"messages": r["messages"], "max_tokens": r.get("max_tokens", 64)} for r in rows]


def _ask(client: OpenAI, request: dict) -> tuple[str, float]:
    start, first, text = time.perf_counter(), None, []
    for chunk in client.chat.completions.create(model="jaxllama", temperature=0, stream=True, **request):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    return "".join(text), (first or time.perf_counter()) - start


@contextlib.contextmanager
def serving(cmd: list[str], port: int, cwd: Path = REPO, env: dict | None = None):
    """`cmd` (a `jaxllama serve` on `port`) started in its own process group, its URL once /health answers (at
    most 10 minutes: it compiles on start), stopped after."""
    server = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def main(job: str | None = None, clients: int = 16, model: str | None = None, port: int = 8011):
    requests = _requests(Path(job) if job else REPO / "jobs" / "eval.jsonl", clients)
    cmd = [sys.executable, "-m", "jaxllama.cli", "serve", "--port", str(port), "--max-batch", str(clients)]
    cmd += ["--model", model] if model else []
    with serving(cmd, port) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
        for r in requests:  # compile every shape once, so that neither pass pays for it
            _ask(client, r)
        start = time.perf_counter()
        one_by_one = [_ask(client, r) for r in requests]
        sequential = time.perf_counter() - start
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: _ask(client, r), requests))
        concurrent_wall = time.perf_counter() - start
    same = [a[0] == b[0] for a, b in zip(one_by_one, together, strict=True)]
    ttft = sorted(t for _, t in together)[len(together) // 2]
    print(f"{len(requests)} chat requests, greedy: same texts one by one and concurrently: {sum(same)}/{len(same)}")
    n = len(requests)
    print(f"one after another: {sequential:.1f} s; {n} concurrent streaming clients: {concurrent_wall:.1f} s")
    print(f"all finished {sequential / concurrent_wall:.1f}x sooner; concurrent TTFT p50 {1e3 * ttft:.0f} ms")


if __name__ == "__main__":
    fire.Fire(main)
